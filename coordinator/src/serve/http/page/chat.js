// The chat page of `ringllm --serve`: streams replies from this server's
// /v1/chat/completions, keeps the conversation (and the settings, and the API key when the
// server wants one) in localStorage, and shows the model and the cluster's state.
'use strict';

const KEYS = {
  conversation: 'ringllm.conversation',
  settings: 'ringllm.settings',
  apiKey: 'ringllm.apiKey',
};
const POLL_MS = 5000;
// /v1/cluster asks every node of the ring (a connection and a handshake each), so the nodes
// are asked for less often than the rest; a hidden page asks for nothing.
const CLUSTER_POLL_MS = 15000;

const $ = (id) => document.getElementById(id);

function load(name, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(name));
    return v === null ? fallback : v;
  } catch (_) {
    return fallback;
  }
}

function save(name, value) {
  try {
    localStorage.setItem(name, JSON.stringify(value));
  } catch (_) {
    // Private mode or full storage: the page still works, it just forgets.
  }
}

/** Thrown when the server answered 401: the key form is shown. */
class NeedKey extends Error {}

const state = {
  // [{role, content, reasoning?, state?, note?}]: the conversation as shown and as sent (a
  // reasoning model's reasoning is shown, never sent back).
  conversation: load(KEYS.conversation, []),
  apiKey: load(KEYS.apiKey, ''),
  model: null,
  controller: null,
  // When /v1/cluster was last asked (0: not yet), and whether the server has it.
  clusterAt: 0,
  hasCluster: true,
};

function headers() {
  const h = { 'Content-Type': 'application/json' };
  if (state.apiKey) h.Authorization = 'Bearer ' + state.apiKey;
  return h;
}

async function errorText(response) {
  try {
    const j = await response.json();
    if (j && j.error) return typeof j.error === 'string' ? j.error : j.error.message;
  } catch (_) {
    // not JSON
  }
  return 'HTTP ' + response.status;
}

async function api(path, init = {}) {
  const r = await fetch(path, { ...init, headers: headers() });
  if (r.status === 401) {
    askKey(state.apiKey ? await errorText(r) : '');
    throw new NeedKey();
  }
  return r;
}

// ---- the API key -------------------------------------------------------------------------

function askKey(message) {
  $('key-form').hidden = false;
  $('key-error').textContent = message || '';
  $('key').focus();
}

function useKey(event) {
  event.preventDefault();
  state.apiKey = $('key').value.trim();
  save(KEYS.apiKey, state.apiKey);
  $('key').value = '';
  $('key-form').hidden = true;
  $('forget-key').hidden = !state.apiKey;
  state.clusterAt = 0;
  poll();
}

function forgetKey() {
  state.apiKey = '';
  save(KEYS.apiKey, '');
  $('forget-key').hidden = true;
  poll();
}

// ---- settings ----------------------------------------------------------------------------

function loadSettings() {
  const s = load(KEYS.settings, {});
  if (typeof s.system === 'string') $('system').value = s.system;
  if (s.temperature !== undefined) $('temperature').value = s.temperature;
  if (s.maxTokens !== undefined) $('max-tokens').value = s.maxTokens;
}

function saveSettings() {
  save(KEYS.settings, {
    system: $('system').value,
    temperature: $('temperature').value,
    maxTokens: $('max-tokens').value,
  });
}

function settings() {
  const t = parseFloat($('temperature').value);
  const m = parseInt($('max-tokens').value, 10);
  return {
    system: $('system').value.trim(),
    temperature: Number.isFinite(t) ? Math.min(Math.max(t, 0), 2) : 0.7,
    maxTokens: Number.isFinite(m) && m > 0 ? m : 512,
  };
}

// ---- the conversation ----------------------------------------------------------------------

function messageElement(m) {
  const el = document.createElement('div');
  el.className = 'msg ' + m.role;
  el.dataset.state = m.state || 'done';
  const role = document.createElement('div');
  role.className = 'role';
  role.textContent = m.role;
  // A reasoning model's reasoning (`reasoning_content`), dimmed above the answer.
  const reasoning = document.createElement('div');
  reasoning.className = 'reasoning';
  reasoning.textContent = m.reasoning || '';
  const text = document.createElement('div');
  text.className = 'text';
  text.textContent = m.content;
  const note = document.createElement('div');
  note.className = 'note';
  note.textContent = m.note || '';
  el.append(role, reasoning, text, note);
  return el;
}

function render() {
  const log = $('log');
  log.replaceChildren(...state.conversation.map(messageElement));
  log.scrollTop = log.scrollHeight;
}

function persist() {
  // An answer cut off by a reload is kept as what it was.
  const kept = state.conversation.map((m) =>
    m.state === 'streaming' ? { ...m, state: 'stopped', note: 'interrupted' } : m);
  save(KEYS.conversation, kept);
}

function setBusy(busy) {
  $('send').disabled = busy;
  $('stop').disabled = !busy;
  $('new-chat').disabled = busy;
}

/** Reads an SSE stream, calling `onData` with each `data:` payload. */
async function readEvents(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n')) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, '');
      buffer = buffer.slice(end + 1);
      if (line.startsWith('data:')) onData(line.slice(5).trim());
    }
  }
}

async function send(event) {
  if (event) event.preventDefault();
  const input = $('input');
  const text = input.value.trim();
  if (!text || state.controller) return;
  $('error').textContent = '';
  const s = settings();
  const user = { role: 'user', content: text };
  state.conversation.push(user);
  const messages = [];
  if (s.system) messages.push({ role: 'system', content: s.system });
  for (const m of state.conversation) {
    if (m.state !== 'error') messages.push({ role: m.role, content: m.content });
  }
  const reply = { role: 'assistant', content: '', reasoning: '', state: 'streaming', note: '' };
  state.conversation.push(reply);
  input.value = '';
  render();
  persist();
  const log = $('log');
  const el = log.lastElementChild;
  const textEl = el.querySelector('.text');
  const reasoningEl = el.querySelector('.reasoning');
  const noteEl = el.querySelector('.note');
  const update = () => {
    reasoningEl.textContent = reply.reasoning;
    textEl.textContent = reply.content;
    noteEl.textContent = reply.note;
    el.dataset.state = reply.state;
    log.scrollTop = log.scrollHeight;
  };
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let tokens = 0;
  let finish = null;
  try {
    const body = {
      messages,
      stream: true,
      temperature: s.temperature,
      max_tokens: s.maxTokens,
    };
    if (state.model) body.model = state.model;
    const r = await api('/v1/chat/completions', {
      method: 'POST',
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    await readEvents(r.body, (data) => {
      if (data === '[DONE]') return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const delta = choice.delta || {};
      if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
      if (delta.content) reply.content += delta.content;
      if (delta.content || delta.reasoning_content) {
        tokens += 1;
        update();
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    });
    const seconds = (performance.now() - started) / 1000;
    reply.state = 'done';
    reply.note = (finish === 'length' ? 'cut at max tokens · ' : '') +
      tokens + ' chunks in ' + seconds.toFixed(1) + ' s';
  } catch (e) {
    if (e.name === 'AbortError') {
      reply.state = 'stopped';
      reply.note = 'stopped';
    } else if (e instanceof NeedKey) {
      // Take the turn back: it is sent again once the key is given.
      state.conversation.splice(-2, 2);
      input.value = text;
      render();
    } else {
      reply.state = 'error';
      reply.note = e.message;
      $('error').textContent = e.message;
    }
  } finally {
    state.controller = null;
    setBusy(false);
    if (state.conversation.includes(reply)) update();
    persist();
    input.focus();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  if (state.controller) return;
  state.conversation = [];
  persist();
  render();
  $('error').textContent = '';
}

// ---- model and cluster status --------------------------------------------------------------

function fact(k, v) {
  if (v === null || v === undefined || typeof v === 'object') return null;
  return k + ' ' + v;
}

function nodeElement(name, facts, missing) {
  const el = document.createElement('div');
  el.className = 'node' + (missing ? ' missing' : '');
  const n = document.createElement('div');
  n.className = 'name';
  n.textContent = name;
  const f = document.createElement('div');
  f.className = 'facts';
  f.textContent = facts;
  el.append(n, f);
  return el;
}

function showStatus(label, kind) {
  const s = $('status');
  s.textContent = label;
  s.dataset.state = kind;
}

/** /v1/cluster (when the server has it): any node objects, their scalar fields shown. */
function showCluster(j) {
  const nodes = Array.isArray(j.nodes) ? j.nodes : [];
  const els = nodes.map((n) => {
    if (typeof n !== 'object' || n === null) return nodeElement(String(n), '', false);
    const name = n.name || n.address || n.addr || 'node';
    const facts = Object.entries(n)
      .filter(([k]) => k !== 'name')
      .map(([k, v]) => fact(k, v))
      .filter(Boolean)
      .join(' · ');
    const bad = n.health && n.health !== 'ok' && n.health !== 'healthy';
    return nodeElement(name, facts, bad);
  });
  $('cluster').replaceChildren(...(els.length ? els : [nodeElement('this machine', 'no ring', false)]));
}

/** Without /v1/cluster: /health's node list. */
function showHealth(h) {
  const nodes = (h.nodes || []).map((n) => nodeElement(n, 'in the ring', false));
  const missing = (h.missing || []).map((n) => nodeElement(n, 'missing', true));
  const all = nodes.concat(missing);
  if (!all.length) all.push(nodeElement('one machine', 'the whole model in this process', false));
  $('cluster').replaceChildren(...all);
}

async function pollLoad() {
  const r = await api('/metrics');
  if (!r.ok) return;
  const text = await r.text();
  const value = (name) => {
    const m = text.match(new RegExp('^' + name + ' (\\S+)$', 'm'));
    return m ? Number(m[1]) : null;
  };
  const busy = value('ringllm_slots_busy');
  const slots = value('ringllm_slots_total');
  const rate = value('ringllm_decode_tokens_per_second');
  const parts = [];
  if (busy !== null && slots !== null) parts.push('slots ' + busy + '/' + slots);
  if (rate !== null) parts.push(rate.toFixed(1) + ' tok/s');
  $('load').textContent = parts.join(' · ');
}

/** The nodes: /v1/cluster every CLUSTER_POLL_MS (when the server has it), else /health's list. */
async function pollNodes(health) {
  if (state.hasCluster && Date.now() - state.clusterAt < CLUSTER_POLL_MS) return;
  try {
    if (state.hasCluster) {
      state.clusterAt = Date.now();
      const c = await api('/v1/cluster');
      if (c.ok) return showCluster(await c.json());
      if (c.status === 404) state.hasCluster = false;
    }
    if (health) showHealth(health);
  } catch (e) {
    if (health) showHealth(health);
  }
}

async function poll() {
  // While the key form is up, it waits for the user (useKey polls again); a hidden page
  // waits until it is shown.
  if (!$('key-form').hidden || document.hidden) return;
  try {
    const r = await api('/v1/models');
    if (!r.ok) throw new Error(await errorText(r));
    const j = await r.json();
    state.model = j.data && j.data[0] ? j.data[0].id : null;
    $('model').textContent = state.model || '(no model)';
    $('key-form').hidden = true;
    $('forget-key').hidden = !state.apiKey;
  } catch (e) {
    if (e instanceof NeedKey) showStatus('needs an API key', 'error');
    else showStatus('unreachable', 'error');
    $('model').textContent = '…';
    return;
  }
  const health = await fetch('/health').then((r) => r.json()).catch(() => null);
  if (health && health.status) {
    const label = { ok: 'ready', degraded: 'degraded', unavailable: 'ring down' }[health.status];
    showStatus(label || health.status, health.status);
  }
  await pollNodes(health);
  try {
    await pollLoad();
  } catch (_) {
    // The numbers are a comfort; their absence is not an error.
  }
}

function init() {
  loadSettings();
  render();
  $('forget-key').hidden = !state.apiKey;
  $('composer').addEventListener('submit', send);
  $('stop').addEventListener('click', stop);
  $('new-chat').addEventListener('click', newChat);
  $('key-form').addEventListener('submit', useKey);
  $('forget-key').addEventListener('click', forgetKey);
  for (const id of ['system', 'temperature', 'max-tokens']) {
    $(id).addEventListener('change', saveSettings);
    $(id).addEventListener('input', saveSettings);
  }
  $('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) send(e);
  });
  document.addEventListener('visibilitychange', () => {
    if (!document.hidden) poll();
  });
  poll();
  setInterval(poll, POLL_MS);
}

init();
