//! Adapter choice and the device handle every other part of the crate shares.

use std::sync::Arc;

/// Errors of the GPU backend. Every one names what failed and where.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found{0}")]
    NoAdapter(String),
    #[error("GPU adapter {adapter}: requesting a device failed: {why}")]
    RequestDevice { adapter: String, why: String },
    #[error("GPU {adapter}: the device was lost ({why})")]
    DeviceLost { adapter: String, why: String },
    #[error("GPU {adapter}: {what}: {why}")]
    Op {
        adapter: String,
        what: String,
        why: String,
    },
    #[error("GPU: {0}")]
    Invalid(String),
}

/// How to choose an adapter.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// Accept a software rasterizer (lavapipe, llvmpipe, WARP, SwiftShader). `auto` on a node
    /// does not; tests and `--backend gpu` do.
    pub allow_software: bool,
    /// Do not use f16 shader arithmetic even if the adapter has it.
    pub no_f16: bool,
    /// Do not use subgroup operations even if the adapter has them.
    pub no_subgroups: bool,
}

/// What a node reports about its adapter (capabilities, `bench`, logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSummary {
    pub name: String,
    /// "Vulkan", "Metal", "Dx12", …
    pub backend: String,
    /// "DiscreteGpu", "IntegratedGpu", "VirtualGpu", "Cpu", "Other".
    pub device_type: String,
    pub driver: String,
    /// A software rasterizer (device type Cpu, or a known software driver name).
    pub software: bool,
    /// `SHADER_F16` requested and in use.
    pub f16: bool,
    /// Subgroup operations requested and in use, with the adapter's minimum subgroup size.
    pub subgroups: Option<u32>,
    /// Largest storage buffer binding the device accepts, bytes.
    pub max_binding: u64,
}

impl std::fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}, {}", self.name, self.backend, self.device_type)?;
        if self.software {
            write!(f, ", software")?;
        }
        if self.f16 {
            write!(f, ", f16")?;
        }
        if let Some(s) = self.subgroups {
            write!(f, ", subgroups ≥ {s}")?;
        }
        write!(f, ")")
    }
}

/// A device and its queue. Cheap to clone (an `Arc` inside).
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<Inner>,
}

struct Inner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    summary: AdapterSummary,
    lost: Arc<std::sync::Mutex<Option<String>>>,
}

fn is_software(info: &wgpu::AdapterInfo) -> bool {
    let n = format!("{} {}", info.name, info.driver).to_lowercase();
    info.device_type == wgpu::DeviceType::Cpu
        || ["llvmpipe", "lavapipe", "swiftshader", "warp", "softpipe"]
            .iter()
            .any(|s| n.contains(s))
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle())
}

/// Every adapter wgpu finds, as summaries (no device is created).
pub fn adapters() -> Vec<AdapterSummary> {
    let inst = instance();
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
        .into_iter()
        .map(|a| summarize(&a.get_info(), &a.limits(), false, None))
        .collect()
}

fn summarize(
    info: &wgpu::AdapterInfo,
    limits: &wgpu::Limits,
    f16: bool,
    subgroups: Option<u32>,
) -> AdapterSummary {
    AdapterSummary {
        name: info.name.clone(),
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        software: is_software(info),
        f16,
        subgroups,
        max_binding: limits.max_storage_buffer_binding_size,
    }
}

impl Gpu {
    /// Opens the best adapter: a discrete GPU, then an integrated one, then (only with
    /// `allow_software`) a software rasterizer.
    pub fn open(opts: &GpuOptions) -> Result<Gpu, GpuError> {
        let inst = instance();
        let mut found = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()));
        let rank = |a: &wgpu::Adapter| {
            let i = a.get_info();
            match (is_software(&i), i.device_type) {
                (true, _) => 3,
                (false, wgpu::DeviceType::DiscreteGpu) => 0,
                (false, wgpu::DeviceType::IntegratedGpu) => 1,
                _ => 2,
            }
        };
        found.sort_by_key(rank);
        let seen: Vec<String> = found.iter().map(|a| a.get_info().name).collect();
        let adapter = found
            .into_iter()
            .find(|a| opts.allow_software || !is_software(&a.get_info()))
            .ok_or_else(|| {
                GpuError::NoAdapter(if seen.is_empty() {
                    String::new()
                } else {
                    format!(
                        " that is not a software rasterizer (found: {})",
                        seen.join(", ")
                    )
                })
            })?;
        Self::from_adapter(adapter, opts)
    }

    fn from_adapter(adapter: wgpu::Adapter, opts: &GpuOptions) -> Result<Gpu, GpuError> {
        let info = adapter.get_info();
        let have = adapter.features();
        let alimits = adapter.limits();
        let mut features = wgpu::Features::empty();
        let f16 = !opts.no_f16 && have.contains(wgpu::Features::SHADER_F16);
        if f16 {
            features |= wgpu::Features::SHADER_F16;
        }
        let sub = !opts.no_subgroups && have.contains(wgpu::Features::SUBGROUP);
        if sub {
            features |= wgpu::Features::SUBGROUP;
        }
        // Ask for the adapter's own buffer limits: weights of one matrix can exceed the
        // 128 MiB default binding size (a 262k-token head).
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: alimits.max_storage_buffer_binding_size,
            max_buffer_size: alimits.max_buffer_size,
            max_storage_buffers_per_shader_stage: alimits
                .max_storage_buffers_per_shader_stage
                .min(16),
            max_compute_workgroup_storage_size: alimits.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: alimits.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: alimits.max_compute_workgroup_size_x,
            ..wgpu::Limits::downlevel_defaults()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("ringllm"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| GpuError::RequestDevice {
            adapter: info.name.clone(),
            why: e.to_string(),
        })?;
        let lost = Arc::new(std::sync::Mutex::new(None));
        let l2 = Arc::clone(&lost);
        device.set_device_lost_callback(move |reason, msg| {
            if let Ok(mut g) = l2.lock() {
                *g = Some(format!("{reason:?}: {msg}"));
            }
        });
        let subgroups = sub.then_some(info.subgroup_min_size.max(1));
        let summary = summarize(&info, &limits, f16, subgroups);
        tracing::info!(adapter = %summary, "GPU device opened");
        Ok(Gpu {
            inner: Arc::new(Inner {
                device,
                queue,
                summary,
                lost,
            }),
        })
    }

    pub fn device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    pub fn summary(&self) -> &AdapterSummary {
        &self.inner.summary
    }

    /// `Err(DeviceLost)` once the device has been lost (checked before and after every
    /// submission: a lost device fails the request that used it, cleanly).
    pub fn check_lost(&self) -> Result<(), GpuError> {
        let g = self.inner.lost.lock().map_err(|_| GpuError::DeviceLost {
            adapter: self.inner.summary.name.clone(),
            why: "lost-state lock poisoned".into(),
        })?;
        match &*g {
            Some(why) => Err(GpuError::DeviceLost {
                adapter: self.inner.summary.name.clone(),
                why: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks the device lost (tests; `debug` fault injection), as a driver reset would.
    pub fn simulate_loss(&self, why: &str) {
        if let Ok(mut g) = self.inner.lost.lock() {
            *g = Some(format!("simulated: {why}"));
        }
    }

    /// An error of operation `what` on this device.
    pub fn op_error(&self, what: &str, why: impl std::fmt::Display) -> GpuError {
        GpuError::Op {
            adapter: self.inner.summary.name.clone(),
            what: what.to_string(),
            why: why.to_string(),
        }
    }

    /// A small uniform buffer holding `bytes` (a dispatch's parameters). Every dispatch gets
    /// its own: several dispatches recorded in one command buffer cannot share one buffer
    /// rewritten with `queue.write_buffer` (every write lands before the whole submission).
    pub fn uniform(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        use wgpu::util::DeviceExt;
        self.inner
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            })
    }

    /// A storage buffer of `bytes` bytes (rounded up to 4), zeroed, usable as a copy source
    /// and destination.
    pub fn storage(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        let size = bytes.max(4).div_ceil(4) * 4;
        let max = self.inner.device.limits().max_buffer_size;
        if size > max {
            return Err(self.op_error(
                &format!("allocating {label}"),
                format!("{size} bytes exceeds the device's largest buffer ({max} bytes)"),
            ));
        }
        Ok(self.inner.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer initialized with `bytes` (padded with zeros to a multiple of 4).
    pub fn storage_init(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        let buf = self.storage(label, bytes.len() as u64)?;
        let whole = bytes.len() / 4 * 4;
        if whole > 0 {
            self.inner.queue.write_buffer(&buf, 0, &bytes[..whole]);
        }
        if whole < bytes.len() {
            let mut tail = [0u8; 4];
            tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
            self.inner.queue.write_buffer(&buf, whole as u64, &tail);
        }
        Ok(buf)
    }

    /// Copies `len` f32 values from `buf` at element `off` back to the host (waits).
    pub fn read_f32(&self, buf: &wgpu::Buffer, off: u64, out: &mut [f32]) -> Result<(), GpuError> {
        let bytes = out.len() as u64 * 4;
        if bytes == 0 {
            return Ok(());
        }
        let staging = self.inner.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self
            .inner
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("readback"),
            });
        enc.copy_buffer_to_buffer(buf, off * 4, &staging, 0, bytes);
        self.inner.queue.submit([enc.finish()]);
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|e| self.op_error("readback", e))?
            .map_err(|e| self.op_error("readback", e))?;
        {
            let view = slice
                .get_mapped_range()
                .map_err(|e| self.op_error("readback map", e))?;
            for (o, c) in out.iter_mut().zip(view.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        staging.unmap();
        Ok(())
    }

    /// Writes `data` into `buf` at element `off` (applied before the next submission).
    pub fn write_f32(&self, buf: &wgpu::Buffer, off: u64, data: &[f32]) {
        if !data.is_empty() {
            self.inner
                .queue
                .write_buffer(buf, off * 4, bytemuck::cast_slice(data));
        }
    }

    /// A compute pipeline from WGSL `source`, entry point `entry`, with an automatic layout.
    pub fn pipeline(
        &self,
        label: &str,
        source: &str,
        entry: &str,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        let dev = &self.inner.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = dev.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let pipe = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(self.op_error(&format!("compiling shader {label}"), e));
        }
        Ok(pipe)
    }

    /// Waits for every submitted command buffer to finish.
    pub fn wait(&self) -> Result<(), GpuError> {
        self.inner
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.op_error("poll", e))?;
        self.check_lost()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens whatever adapter exists (lavapipe in CI) and reports it.
    #[test]
    fn opens_an_adapter() {
        let gpu = Gpu::open(&GpuOptions {
            allow_software: true,
            ..Default::default()
        })
        .expect("an adapter (install mesa-vulkan-drivers for lavapipe)");
        let s = gpu.summary();
        assert!(!s.name.is_empty());
        gpu.wait().unwrap();
        gpu.simulate_loss("test");
        assert!(matches!(gpu.check_lost(), Err(GpuError::DeviceLost { .. })));
    }
}
