//! Which MLX backend this process computes on: the linked CPU build, or a CUDA/Metal
//! libmlx loaded in its place. Kernels differ per backend, and so do the layouts that
//! make a multi-token verify round exactly like one-token decoding.

use std::sync::OnceLock;

use mlx_rs::{Device, DeviceType, Dtype};

/// The default device kind MLX picked: GPU when the loaded libmlx has a usable one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl Backend {
    /// Asks MLX (see [`Backend::current`] for the cached answer).
    pub fn detect() -> Backend {
        let is_gpu = matches!(
            Device::try_default().ok().and_then(|d| d.get_type().ok()),
            Some(DeviceType::Gpu)
        );
        if !is_gpu {
            return Backend::Cpu;
        }
        let mut cuda = false;
        // SAFETY: writes one bool.
        let status = unsafe { mlx_sys::mlx_cuda_is_available(&mut cuda) };
        if status == 0 && cuda {
            Backend::Cuda
        } else {
            Backend::Metal
        }
    }

    /// The backend of this process, detected once: MLX's default device does not
    /// change while dspec runs.
    pub fn current() -> Backend {
        static CURRENT: OnceLock<Backend> = OnceLock::new();
        *CURRENT.get_or_init(Backend::detect)
    }

    pub fn device_name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "gpu (cuda)",
            Backend::Metal => "gpu (metal)",
        }
    }

    /// `--dtype auto`: f32 on the CPU backend, where bf16 decodes slower than f32
    /// (docs/benchmarks.md says by how much); the checkpoint's own dtype on a GPU.
    pub fn auto_dtype(self) -> Option<Dtype> {
        match self {
            Backend::Cpu => Some(Dtype::Float32),
            Backend::Cuda | Backend::Metal => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_dtype_is_f32_on_cpu_and_checkpoint_dtype_on_gpu() {
        assert_eq!(Backend::Cpu.auto_dtype(), Some(Dtype::Float32));
        assert_eq!(Backend::Cuda.auto_dtype(), None);
    }

    #[test]
    fn the_cached_backend_is_the_detected_one() {
        assert_eq!(Backend::current(), Backend::detect());
    }
}
