//! Tests of the tool-call formats: the table, parsing fixtures written from each format's
//! documentation, streaming against parsing, and the prompt.

use super::*;
use crate::text::template::{builtin, ChatTemplate, Message, TemplateVars};
use proptest::prelude::*;
use serde_json::json;

mod grammar_tests;

fn weather() -> Tool {
    Tool {
        name: "get_weather".into(),
        description: Some("Current weather in a city".into()),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city"],
            "additionalProperties": false
        }),
    }
}

fn time() -> Tool {
    Tool {
        name: "get_time".into(),
        description: None,
        parameters: json!({"type": "object", "properties": {}}),
    }
}

/// Calls without their random ids.
fn named(calls: &[ToolCall]) -> Vec<(String, Value)> {
    calls
        .iter()
        .map(|c| (c.name.clone(), c.arguments.clone()))
        .collect()
}

fn paris() -> (String, Value) {
    ("get_weather".to_string(), json!({"city": "Paris"}))
}

#[test]
fn call_ids_look_like_openais() {
    let a = new_call_id();
    assert_eq!(a.len(), 29);
    assert!(a.starts_with("call_"));
    assert!(a[5..].chars().all(|c| c.is_ascii_alphanumeric()));
    assert_ne!(a, new_call_id());
}

#[test]
fn tools_deserialize_with_a_default_schema() {
    let t: Tool = serde_json::from_value(json!({"name": "f"})).expect("a tool");
    assert_eq!(t.parameters, json!({"type": "object"}));
    assert_eq!(t.description, None);
    assert_eq!(
        openai_tools(&[t]),
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    );
}

#[test]
fn formats_are_detected_by_template_then_architecture() {
    let qwen = "{%- if tools %}<tool_call>{% endif %}<|im_start|>";
    let llama31 = "<|start_header_id|>ipython<|end_header_id|><|python_tag|>";
    let mistral = "[INST]{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]";
    let cases: &[(Option<&str>, &str, ToolFormat)] = &[
        (Some(qwen), "qwen2", ToolFormat::Hermes),
        // SmolLM2: architecture llama, plain ChatML.
        (builtin("chatml"), "llama", ToolFormat::Hermes),
        (Some(llama31), "llama", ToolFormat::Llama3),
        (builtin("llama3"), "llama", ToolFormat::Llama3),
        (Some(mistral), "llama", ToolFormat::Mistral),
        (builtin("harmony"), "gpt-oss", ToolFormat::Harmony),
        (
            Some("{{ 'to=functions.' + name }}"),
            "llama",
            ToolFormat::Harmony,
        ),
        (builtin("gemma"), "gemma3", ToolFormat::Gemma),
        (builtin("phi3"), "phi3", ToolFormat::Hermes),
        // No template: the architecture tells.
        (None, "gemma2", ToolFormat::Gemma),
        (None, "gemma3", ToolFormat::Gemma),
        (None, "gpt-oss", ToolFormat::Harmony),
        (None, "llama", ToolFormat::Llama3),
        (None, "mistral3", ToolFormat::Mistral),
        (None, "qwen3", ToolFormat::Hermes),
        (None, "unknown", ToolFormat::Hermes),
        (Some("{{ messages }}"), "qwen3moe", ToolFormat::Hermes),
    ];
    for (src, arch, want) in cases {
        assert_eq!(ToolFormat::detect(*src, arch), *want, "{src:?} {arch}");
    }
    let names: Vec<&str> = ToolFormat::ALL.iter().map(|f| f.name()).collect();
    assert_eq!(names, ["hermes", "llama3", "mistral", "harmony", "gemma"]);
}

#[test]
fn hermes_replies() {
    let p = parse(
        ToolFormat::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    );
    assert_eq!(named(&p.calls), [paris()]);
    assert_eq!(p.content, "");
    assert!(p.invalid.is_empty());
    // Qwen 3: reasoning first, text, two calls in a row; arguments as a JSON string.
    let p = parse(
        ToolFormat::Hermes,
        "<think>\nThe user wants two things.\n</think>\n\nLet me check.\n<tool_call>\n\
         {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}\n\
         </tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n",
    );
    assert_eq!(
        named(&p.calls),
        [paris(), ("get_time".to_string(), json!({}))]
    );
    assert_eq!(
        p.content,
        "<think>\nThe user wants two things.\n</think>\n\nLet me check."
    );
    // Sloppy: no blanks, no close tag before the next call, none at the end.
    let p = parse(
        ToolFormat::Hermes,
        "<tool_call>{\"name\":\"get_time\",\"arguments\":{}}<tool_call>{\"name\": \"get_weather\", \
         \"arguments\": {\"city\": \"Paris\"}}",
    );
    assert_eq!(
        named(&p.calls),
        [("get_time".to_string(), json!({})), paris()]
    );
    assert_eq!(p.content, "");
    // A close tag inside an argument does not end the call.
    let p = parse(
        ToolFormat::Hermes,
        "<tool_call>\n{\"name\": \"echo\", \"arguments\": {\"s\": \"a</tool_call>b\"}}\n</tool_call>",
    );
    assert_eq!(
        named(&p.calls),
        [("echo".to_string(), json!({"s": "a</tool_call>b"}))]
    );
}

#[test]
fn invalid_calls_stay_in_the_text() {
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }}\n</tool_call>";
    let p = parse(ToolFormat::Hermes, &format!("Sure. {bad} Done."));
    assert!(p.calls.is_empty());
    assert_eq!(p.content, format!("Sure. {bad} Done."));
    assert_eq!(p.invalid, [bad]);
    // Arguments that are not an object, a call without a name, not JSON at all.
    for body in [
        "{\"name\": \"f\", \"arguments\": [1]}",
        "{\"arguments\": {}}",
        "get_weather(city=\"Paris\")",
    ] {
        let text = format!("<tool_call>\n{body}\n</tool_call>");
        let p = parse(ToolFormat::Hermes, &text);
        assert!(p.calls.is_empty(), "{body}");
        assert_eq!(p.invalid, [text.as_str()]);
        assert_eq!(p.content, text);
    }
    // Cut off in the middle of its JSON: text, reported.
    let cut = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci";
    let p = parse(ToolFormat::Hermes, cut);
    assert_eq!((p.content.as_str(), p.invalid.len()), (cut, 1));
    // A reply without calls is its text, trimmed.
    let p = parse(ToolFormat::Hermes, "\n  It is sunny in <b>Paris</b>.  \n");
    assert_eq!(p.content, "It is sunny in <b>Paris</b>.");
    assert!(p.calls.is_empty() && p.invalid.is_empty());
}

#[test]
fn llama3_replies() {
    let p = parse(
        ToolFormat::Llama3,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
    );
    assert_eq!(named(&p.calls), [paris()]);
    let p = parse(
        ToolFormat::Llama3,
        "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
    );
    assert_eq!((named(&p.calls), p.content.as_str()), (vec![paris()], ""));
    // Two objects in a row.
    let p = parse(
        ToolFormat::Llama3,
        "  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n\
         {\"name\": \"get_time\", \"parameters\": {}}",
    );
    assert_eq!(
        named(&p.calls),
        [paris(), ("get_time".to_string(), json!({}))]
    );
    // JSON that is no call, and JSON after text, are text.
    for text in [
        "{\"city\": \"Paris\", \"temp\": 21}",
        "Here: {\"name\": \"get_time\", \"parameters\": {}}",
    ] {
        let p = parse(ToolFormat::Llama3, text);
        assert!(p.calls.is_empty() && p.invalid.is_empty(), "{text}");
        assert_eq!(p.content, text);
    }
    // After the python tag, anything that is not a call is reported.
    let p = parse(
        ToolFormat::Llama3,
        "<|python_tag|>brave_search.call(query=\"x\")",
    );
    assert!(p.calls.is_empty());
    assert_eq!(p.invalid.len(), 1);
}

#[test]
fn mistral_replies() {
    let p = parse(
        ToolFormat::Mistral,
        "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, \
         {\"name\": \"get_time\", \"arguments\": {}}]",
    );
    assert_eq!(
        named(&p.calls),
        [paris(), ("get_time".to_string(), json!({}))]
    );
    assert_eq!(p.content, "");
    // The newer syntax, one marker per call, with and without a call id.
    let p = parse(
        ToolFormat::Mistral,
        "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}",
    );
    assert_eq!(
        named(&p.calls),
        [paris(), ("get_time".to_string(), json!({}))]
    );
    assert_eq!(p.content, "");
    let p = parse(ToolFormat::Mistral, "Well [TOOL_CALLS] maybe later");
    assert!(p.calls.is_empty());
    assert_eq!(p.content, "Well [TOOL_CALLS] maybe later");
    assert_eq!(p.invalid, ["[TOOL_CALLS] maybe"]);
}

#[test]
fn harmony_replies() {
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
                <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                {\"city\":\"Paris\"}";
    for reply in [text.to_string(), format!("{text}<|call|>")] {
        let p = parse(ToolFormat::Harmony, &reply);
        assert_eq!(named(&p.calls), [paris()], "{reply}");
        // What is not a call stays, markup and all, for the channel parser.
        assert_eq!(
            p.content,
            "<|channel|>analysis<|message|>Need the weather.<|end|>"
        );
    }
    // The recipient in the role's header, and a final answer that is no call.
    let p = parse(
        ToolFormat::Harmony,
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
    );
    assert_eq!(named(&p.calls), [("get_time".to_string(), json!({}))]);
    let plain = "<|channel|>final<|message|>It is sunny.";
    assert_eq!(parse(ToolFormat::Harmony, plain).content, plain);
    let p = parse(
        ToolFormat::Harmony,
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>now<|call|>",
    );
    assert!(p.calls.is_empty());
    assert_eq!(p.invalid.len(), 1);
}

#[test]
fn gemma_replies() {
    let p = parse(
        ToolFormat::Gemma,
        "I'll look it up.\n```tool_call\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
    );
    assert_eq!(named(&p.calls), [paris()]);
    assert_eq!(p.content, "I'll look it up.");
    let code = "```python\nprint(1)\n```";
    assert_eq!(parse(ToolFormat::Gemma, code).content, code);
}

/// Replies in every format, for the streaming property.
fn corpus() -> Vec<(ToolFormat, &'static str)> {
    vec![
        (
            ToolFormat::Hermes,
            "Let me see.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa<ris>\"}}\n</tool_call>\n\
             <tool_call>{\"name\": \"get_time\", \"arguments\": \"{}\"}</tool_call> <tool_ and after",
        ),
        (
            ToolFormat::Hermes,
            "  <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"</tool_call>\"}}  <tool_call>{bad}</tool_call>\n\n x <tool_call>\n{\"name\": \"g\"",
        ),
        (
            ToolFormat::Llama3,
            " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}} \n{\"name\": \"get_time\", \"parameters\": {}} then text <|python_tag|>{\"name\": \"h\"}",
        ),
        (
            ToolFormat::Llama3,
            "{\"not\": \"a call\"} and {\"name\": \"x\"} <|python_tag|>{\"name\": \"x\"}",
        ),
        (
            ToolFormat::Mistral,
            "ok [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}][TOOL_CALLS]b[CALL_ID]x1[ARGS]{\"k\": [1, 2]} [TOOL_CALLS] no [TOOL_CALL",
        ),
        (
            ToolFormat::Harmony,
            "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": \"<|call|>\"}<|call|>",
        ),
        (
            ToolFormat::Harmony,
            "<|channel|>final<|message|>Answer <|start|>assistant to=functions.g<|channel|>commentary json<|message|>{}",
        ),
        (
            ToolFormat::Gemma,
            "Sure ```tool_call\n{\"name\": \"a\", \"arguments\": {}}\n``` and ```tool_call\n{\"name\": \"b\"}\n``",
        ),
    ]
}

fn run_stream(format: ToolFormat, pieces: &[&str]) -> (String, Vec<(String, Value)>) {
    let mut s = ToolStream::new(format);
    let mut items = Vec::new();
    for p in pieces {
        items.extend(s.push(p));
    }
    items.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for i in items {
        match i {
            StreamItem::Content(c) => content.push_str(&c),
            StreamItem::Call(c) => calls.push((c.name, c.arguments)),
        }
    }
    (content, calls)
}

/// `text` cut at the char boundaries nearest `cuts`.
fn cut<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut c = c % (text.len() + 1);
            while !text.is_char_boundary(c) {
                c -= 1;
            }
            c
        })
        .collect();
    at.push(0);
    at.push(text.len());
    at.sort_unstable();
    at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

#[test]
fn streaming_byte_by_byte_matches_parsing() {
    for (format, text) in corpus() {
        let whole = parse(format, text);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (content, calls) = run_stream(format, &pieces);
        assert_eq!(content, whole.content, "{format:?} {text}");
        assert_eq!(calls, named(&whole.calls), "{format:?} {text}");
        assert!(!whole.calls.is_empty(), "{text}");
    }
}

#[test]
fn text_is_released_early_and_calls_when_complete() {
    let mut s = ToolStream::new(ToolFormat::Hermes);
    assert_eq!(s.push("Hello"), [StreamItem::Content("Hello".into())]);
    // Blanks wait for what follows; a possible marker is held.
    assert_eq!(s.push(" <tool"), []);
    assert_eq!(s.push("box>"), [StreamItem::Content(" <toolbox>".into())]);
    assert_eq!(s.push("\n<tool_call>\n{\"name\": \"get_time\""), []);
    let items = s.push(", \"arguments\": {}}\n</tool_call>");
    assert!(
        matches!(&items[..], [StreamItem::Call(c)] if c.name == "get_time"),
        "{items:?}"
    );
    assert_eq!(s.push("\n"), []);
    assert_eq!(s.finish(), []);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_split_streams_like_parsing(
        which in 0usize..8,
        cuts in proptest::collection::vec(0usize..400, 0..12),
    ) {
        let (format, text) = corpus()[which];
        let whole = parse(format, text);
        let (content, calls) = run_stream(format, &cut(text, &cuts));
        prop_assert_eq!(content, whole.content);
        prop_assert_eq!(calls, named(&whole.calls));
    }

    #[test]
    fn calls_we_write_are_read_back(
        format in proptest::sample::select(ToolFormat::ALL.to_vec()),
        city in "[a-zA-Z <>\"\\\\{}\\[\\]|,:é]{0,12}",
        n in 1usize..3,
    ) {
        let calls: Vec<ToolCall> = (0..n)
            .map(|i| ToolCall::new(format!("f{i}"), json!({"city": city, "n": i})))
            .collect();
        let text = format_calls(format, &calls);
        let p = parse(format, &text);
        prop_assert_eq!(named(&p.calls), named(&calls), "{}", text);
        prop_assert_eq!(p.content, "");
    }
}

fn conversation() -> Vec<Message> {
    let call = ToolCall {
        id: "call_1".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Paris"}),
    };
    let time = ToolCall {
        id: "call_2".into(),
        name: "get_time".into(),
        arguments: json!({}),
    };
    vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Weather and time in Paris?"),
        Message {
            tool_calls: vec![call, time],
            ..Message::new("assistant", "")
        },
        Message {
            tool_call_id: Some("call_1".into()),
            ..Message::new("tool", "{\"temp\": 21}")
        },
        Message {
            tool_call_id: Some("call_2".into()),
            ..Message::new("tool", "12:00")
        },
    ]
}

#[test]
fn chatml_without_tools_gets_a_system_prompt_and_text_history() {
    let src = builtin("chatml").expect("chatml");
    let choice = ToolChoice::Auto;
    let (msgs, var) = prepare(
        ToolFormat::Hermes,
        src,
        &conversation(),
        &[weather(), time()],
        &choice,
    );
    assert_eq!(var, None);
    let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    let system = &msgs[0].content;
    assert!(
        system.starts_with("Be brief.\n\nYou can call functions"),
        "{system}"
    );
    assert!(system.contains("{\"name\": \"get_weather\", \"description\": \"Current weather in a city\", \"parameters\": {\"type\": \"object\""));
    assert!(system.contains("<tool_call>\n{\"name\": <function name>"));
    assert_eq!(
        msgs[2].content,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
         <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
    );
    assert!(msgs[2].tool_calls.is_empty());
    assert_eq!(
        msgs[3].content,
        "<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    );
    let t = ChatTemplate::new(src, "", "").expect("compiles");
    let prompt = t.render(&msgs, true).expect("renders");
    assert!(
        prompt.ends_with("</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        "{prompt}"
    );
    // Required and named choices say so; no system message yet: one is added.
    let (msgs, _) = prepare(
        ToolFormat::Hermes,
        src,
        &conversation()[1..2],
        &[weather()],
        &ToolChoice::Named("get_weather".into()),
    );
    assert_eq!(msgs.len(), 2);
    assert!(msgs[0]
        .content
        .ends_with("Call the function get_weather now."));
    // None: the tools are not described, the history is still text.
    let (msgs, var) = prepare(
        ToolFormat::Hermes,
        src,
        &conversation(),
        &[weather()],
        &ToolChoice::None,
    );
    assert_eq!((msgs[0].content.as_str(), var), ("Be brief.", None));
    assert!(msgs[2].content.starts_with("<tool_call>"));
}

#[test]
fn results_per_format_in_templates_without_tools() {
    let src = builtin("llama3").expect("llama3");
    let (msgs, _) = prepare(
        ToolFormat::Llama3,
        src,
        &conversation(),
        &[weather()],
        &ToolChoice::Auto,
    );
    let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "ipython", "ipython"]);
    assert_eq!(
        msgs[2].content,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n{\"name\": \"get_time\", \"parameters\": {}}"
    );
    let (msgs, _) = prepare(
        ToolFormat::Gemma,
        builtin("gemma").expect("gemma"),
        &conversation(),
        &[weather()],
        &ToolChoice::Auto,
    );
    assert_eq!(
        msgs[3].content,
        "```tool_output\n{\"temp\": 21}\n```\n```tool_output\n12:00\n```"
    );
    let (msgs, _) = prepare(
        ToolFormat::Harmony,
        builtin("harmony").expect("harmony"),
        &conversation(),
        &[weather()],
        &ToolChoice::Auto,
    );
    assert_eq!(
        msgs[3].content,
        "Result of functions.get_weather:\n{\"temp\": 21}\nResult of functions.get_time:\n12:00"
    );
    let (msgs, _) = prepare(
        ToolFormat::Mistral,
        "{{ messages }}",
        &conversation(),
        &[weather()],
        &ToolChoice::Auto,
    );
    assert_eq!(msgs[2].content, "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]");
}

/// A small template that handles tools the way Qwen 2.5's does.
const QWEN_LIKE: &str = r#"
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not tools %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for tool_call in message.tool_calls %}
{{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"#;

#[test]
fn templates_with_tools_get_them_as_a_variable() {
    let (msgs, var) = prepare(
        ToolFormat::detect(Some(QWEN_LIKE), "qwen2"),
        QWEN_LIKE,
        &conversation(),
        &[weather()],
        &ToolChoice::Required,
    );
    assert_eq!(msgs, conversation());
    let var = var.expect("tools passed");
    assert_eq!(var, openai_tools(&[weather()]));
    let t = ChatTemplate::new(QWEN_LIKE, "", "").expect("compiles");
    let vars = TemplateVars {
        tools: Some(var),
        ..TemplateVars::default()
    };
    let prompt = t.render_with(&msgs, true, &vars).expect("renders");
    assert!(prompt.starts_with(
        "<|im_start|>system\nBe brief.\n# Tools\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Current weather in a city\""
    ), "{prompt}");
    assert!(prompt.contains(
        "<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
    ), "{prompt}");
    assert!(prompt.contains("<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), "{prompt}");
    // The id and function of each call, as templates read them.
    let ids = ChatTemplate::new(
        "{% for c in messages[2].tool_calls %}{{ c.id }} {{ c.type }} {{ c.function.name }};{% endfor %}{{ messages[3].tool_call_id }}",
        "",
        "",
    )
    .expect("compiles");
    assert_eq!(
        ids.render(&conversation(), false).expect("renders"),
        "call_1 function get_weather;call_2 function get_time;call_1"
    );
    // none: no tools for the template either.
    let (_, var) = prepare(
        ToolFormat::Hermes,
        QWEN_LIKE,
        &conversation(),
        &[weather()],
        &ToolChoice::None,
    );
    assert_eq!(var, None);
}

#[test]
fn templates_that_read_tools_are_told_apart() {
    for name in crate::text::template::builtin_names() {
        let src = builtin(name).expect("builtin");
        assert!(!template_handles_tools(src), "{name}");
    }
    assert!(template_handles_tools(QWEN_LIKE));
    for yes in [
        "{% if tools is defined and tools %}x{% endif %}",
        "{{- tools | tojson }}",
        "{%- for t in tools -%}{%- endfor %}",
    ] {
        assert!(template_handles_tools(yes), "{yes}");
    }
    for no in [
        "{{ 'the template has no tools' }}",
        "{{ \"tools\" }} tools {# tools #}",
        "{{ my_tools }}",
        "{% if x %}tools{% endif %}",
        "{{ tools",
    ] {
        assert!(!template_handles_tools(no), "{no}");
    }
}

/// SmolLM2's own template (plain ChatML, architecture llama): Hermes, tools described by us.
#[test]
fn smollm2_gets_hermes_in_its_own_template() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/smollm2-135m-instruct-q4_1.gguf");
    let file = ringllm_model::gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models)", path.display()));
    let src = file
        .metadata()
        .opt_str("tokenizer.chat_template")
        .expect("metadata")
        .expect("SmolLM2 has a chat template");
    let format = ToolFormat::detect(Some(src), "llama");
    assert_eq!(format, ToolFormat::Hermes);
    assert!(!template_handles_tools(src));
    let (msgs, var) = prepare(
        format,
        src,
        &conversation()[1..],
        &[weather(), time()],
        &ToolChoice::Required,
    );
    assert_eq!(var, None);
    let t = ChatTemplate::new(src, "<|im_start|>", "<|im_end|>").expect("compiles");
    let prompt = t.render(&msgs, true).expect("renders");
    assert!(
        prompt.starts_with("<|im_start|>system\nYou can call functions"),
        "{prompt}"
    );
    assert!(prompt.contains("Call at least one of the functions now.<|im_end|>\n"));
    assert!(prompt.contains(
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
    ));
    assert!(prompt.ends_with(
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ), "{prompt}");
}
