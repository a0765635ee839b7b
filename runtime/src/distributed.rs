//! MLX's distributed engine (mlx-c's `mlx_distributed_*`) behind a safe [`Group`]:
//! joining a group of processes and the collectives tensor parallelism needs.
//!
//! dspec builds no transport of its own: MLX carries the bytes (ring over TCP, MPI, NCCL
//! on CUDA, JACCL over Thunderbolt). The collectives are graph nodes like any MLX op:
//! they run when an array depending on them is evaluated, on the stream MLX's backend
//! communicates on (the CPU stream for ring).

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

use crate::slicing::op;

/// The backends MLX 0.32.2 knows, in the order its `any` tries them (nccl only where
/// CUDA is available).
pub const BACKENDS: [&str; 4] = ["ring", "mpi", "nccl", "jaccl"];

/// The mlx-c group handle, freed with the last [`Group`] clone.
struct Handle(mlx_sys::mlx_distributed_group);

// SAFETY: the handle points to an `mlx::core::distributed::Group`, a shared pointer to
// the backend's state; MLX's collectives take the group by value from whichever thread
// builds the graph, and the handle itself is never mutated after init.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was made by mlx_distributed_group_new/init and is freed once.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.0);
        }
    }
}

/// A group of processes that MLX's collectives run over; rank 0 of 1 when the process
/// runs alone. Clones share one group (a pointer each: layers keep one).
#[derive(Clone)]
pub struct Group(Arc<Members>);

struct Members {
    handle: Handle,
    rank: i32,
    size: i32,
    backend: String,
    /// Collectives built so far, by every clone: a watchdog reads it to tell a process
    /// that keeps building steps from one stuck waiting on a peer.
    built: AtomicU64,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group {{ rank: {}, size: {}, backend: {} }}",
            self.0.rank, self.0.size, self.0.backend
        )
    }
}

/// Whether the loaded libmlx was built with `backend` (`ring`, `mpi`, `nccl`, `jaccl`,
/// or `any`).
pub fn is_available(backend: &str) -> bool {
    let Ok(name) = CString::new(backend) else {
        return false;
    };
    // SAFETY: reads a NUL-terminated string that outlives the call.
    unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
}

// mlx-rs 0.33's process-wide MLX error handler (exported unmangled by mlx-rs). It is put
// back after `init`, which swaps in one of its own to read MLX's message: mlx-rs keeps
// the last message private, and an init failure's message ("[ring] Couldn't connect
// ...") is what a user needs.
extern "C" {
    fn default_mlx_error_handler(msg: *const c_char, data: *mut c_void);
}

/// mlx-c keeps a handler's data only with a destructor; `init` owns the data itself.
extern "C" fn keep_data(_data: *mut c_void) {}

extern "C" fn capture_error(msg: *const c_char, data: *mut c_void) {
    if msg.is_null() || data.is_null() {
        return;
    }
    // SAFETY: `data` is the `String` that `init` passes with this handler, alive for
    // the call; `msg` is MLX's NUL-terminated message.
    unsafe {
        let out = &mut *(data as *mut String);
        *out = CStr::from_ptr(msg).to_string_lossy().into_owned();
    }
}

/// Joins the group MLX's environment describes (`MLX_RANK` with `MLX_HOSTFILE` for ring,
/// `MLX_WORLD_SIZE`/`NCCL_HOST_IP`/`NCCL_PORT` for nccl, an MPI launcher's variables for
/// mpi), through `backend` (one of [`BACKENDS`] or `any`). `strict`: a missing or
/// broken environment is an error; otherwise the process runs alone (size 1).
///
/// Blocks until every rank has connected (ring: each rank accepts its left neighbour's
/// connection); callers bound that wait themselves. Call it before starting threads
/// that use MLX: it swaps MLX's error handler for the duration of the call.
pub fn init(backend: &str, strict: bool) -> Result<Group, Exception> {
    let name = CString::new(backend)
        .map_err(|_| Exception::custom(format!("bad backend name {backend:?}")))?;
    // Any op registers mlx-rs's handler first (once per process), so that restoring it
    // below restores what mlx-rs set up.
    let _ = Array::from_int(0);
    let mut message = String::new();
    // SAFETY: mlx_distributed_group_new makes an empty handle for init to fill; the
    // capture handler only writes to `message`, which outlives the call; mlx-rs's handler
    // is restored before returning.
    let (status, group) = unsafe {
        let mut group = mlx_sys::mlx_distributed_group_new();
        mlx_sys::mlx_set_error_handler(
            Some(capture_error),
            &mut message as *mut String as *mut c_void,
            Some(keep_data),
        );
        let status = mlx_sys::mlx_distributed_init(&mut group, strict, name.as_ptr());
        mlx_sys::mlx_set_error_handler(Some(default_mlx_error_handler), std::ptr::null_mut(), None);
        (status, Handle(group))
    };
    if status != 0 {
        return Err(Exception::custom(if message.is_empty() {
            format!("MLX could not start its `{backend}` distributed backend")
        } else {
            message
        }));
    }
    // SAFETY: the group was initialised above.
    let (rank, size) = unsafe {
        (
            mlx_sys::mlx_distributed_group_rank(group.0),
            mlx_sys::mlx_distributed_group_size(group.0),
        )
    };
    Ok(Group(Arc::new(Members {
        handle: group,
        rank,
        size,
        backend: backend.to_string(),
        built: AtomicU64::new(0),
    })))
}

impl Group {
    pub fn rank(&self) -> i32 {
        self.0.rank
    }

    pub fn size(&self) -> i32 {
        self.0.size
    }

    /// The backend asked for at init (`any` when MLX chose).
    pub fn backend(&self) -> &str {
        &self.0.backend
    }

    fn raw(&self) -> mlx_sys::mlx_distributed_group {
        self.0.built.fetch_add(1, Ordering::Relaxed);
        self.0.handle.0
    }

    /// How many collectives this process has built on the group (any clone).
    pub fn collectives_built(&self) -> u64 {
        self.0.built.load(Ordering::Relaxed)
    }

    /// The elementwise sum of `x` over every rank (same shape and dtype on all ranks).
    ///
    /// Every rank receives the same bits: the ring backend reduces each segment on one
    /// rank and passes the result around (MLX 0.32's ring.cpp: reduce-scatter, then
    /// all-gather), and NCCL's ring and tree all-reduce broadcast their result likewise.
    pub fn all_sum(&self, x: &Array) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        op("all_sum", |res| unsafe {
            mlx_sys::mlx_distributed_all_sum(res, x.as_ptr(), self.raw(), stream.as_ref().as_ptr())
        })
    }

    /// Every rank's `x` stacked along axis 0 in rank order (`[size·n, ..]` from `[n, ..]`).
    pub fn all_gather(&self, x: &Array) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        op("all_gather", |res| unsafe {
            mlx_sys::mlx_distributed_all_gather(
                res,
                x.as_ptr(),
                self.raw(),
                stream.as_ref().as_ptr(),
            )
        })
    }

    /// Sends `x` to rank `dst` when the returned array is evaluated (ring: neighbours only).
    pub fn send(&self, x: &Array, dst: i32) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        op("send", |res| unsafe {
            mlx_sys::mlx_distributed_send(
                res,
                x.as_ptr(),
                dst,
                self.raw(),
                stream.as_ref().as_ptr(),
            )
        })
    }

    /// An array of `shape` and `dtype` received from rank `src` when evaluated.
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: i32) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        op("recv", |res| unsafe {
            mlx_sys::mlx_distributed_recv(
                res,
                shape.as_ptr(),
                shape.len(),
                u32::from(dtype),
                src,
                self.raw(),
                stream.as_ref().as_ptr(),
            )
        })
    }

    /// `x` as rank 0 holds it, on every rank: the sum of rank 0's `x` and every other
    /// rank's zeros (an integer or float array; exact, since only one term is non-zero).
    pub fn broadcast_from_root(&self, x: &Array) -> Result<Array, Exception> {
        if self.size() == 1 {
            return Ok(x.clone());
        }
        let own = if self.rank() == 0 {
            x.clone()
        } else {
            mlx_rs::ops::zeros_like(x)?
        };
        self.all_sum(&own)
    }

    /// Rank 0's `bytes` on every rank (what the other ranks pass is ignored). The length
    /// goes first, as a fixed-size array the other ranks can receive without knowing
    /// anything, then the bytes; each is a sum of rank 0's values and the others' zeros,
    /// so the bytes arrive exact. Every rank must call it at the same point.
    pub fn broadcast_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>, Exception> {
        if self.size() == 1 {
            return Ok(bytes.to_vec());
        }
        let len = bytes.len() as u64;
        let halves =
            self.broadcast_from_root(&Array::from_slice(&[len as u32, (len >> 32) as u32], &[2]))?;
        halves.eval()?;
        let halves = read::<u32>(&halves)?;
        let len = halves[0] as u64 | (halves[1] as u64) << 32;
        if len == 0 {
            return Ok(Vec::new());
        }
        let Ok(n) = i32::try_from(len) else {
            return Err(Exception::custom(format!(
                "a broadcast from rank 0 announced {len} bytes, more than one MLX array \
                 holds: the ranks are out of step (each took a different collective for this one)"
            )));
        };
        let own = match self.rank() {
            0 => Array::from_slice(bytes, &[n]),
            _ => mlx_rs::ops::zeros::<u8>(&[n])?,
        };
        let summed = self.all_sum(&own)?;
        summed.eval()?;
        Ok(read::<u8>(&summed)?.to_vec())
    }

    /// Whether `flag` is true on any rank, the same answer on every rank (a one-element
    /// all-sum, evaluated). Every rank must call it at the same point.
    pub fn any(&self, flag: bool) -> Result<bool, Exception> {
        if self.size() == 1 {
            return Ok(flag);
        }
        let summed = self.all_sum(&Array::from_slice(&[flag as i32], &[1]))?;
        summed.eval()?;
        Ok(read::<i32>(&summed)?[0] > 0)
    }

    /// Waits for every rank to get here (a one-element all-sum, evaluated).
    pub fn barrier(&self) -> Result<(), Exception> {
        if self.size() == 1 {
            return Ok(());
        }
        self.all_sum(&Array::from_slice(&[1i32], &[1]))?.eval()
    }
}

/// An evaluated array's elements.
fn read<T: mlx_rs::ArrayElement>(x: &Array) -> Result<&[T], Exception> {
    x.try_as_slice::<T>()
        .map_err(|e| Exception::custom(format!("reading a collective's result: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_linked_libmlx_has_the_ring_backend() {
        assert!(is_available("ring"), "ring");
        assert!(is_available("any"), "any");
        assert!(!is_available("carrier-pigeon"));
    }

    /// Without MLX's environment a non-strict init is a group of one whose collectives
    /// are the identity, and a strict one names the variables it missed.
    #[test]
    fn alone_the_group_has_one_member() {
        if std::env::var_os("MLX_RANK").is_some() {
            return;
        }
        // Strict first: MLX caches the group a backend's init made, the empty one too.
        let err = init("ring", true).expect_err("strict without MLX_RANK/MLX_HOSTFILE");
        assert!(err.what().contains("MLX_HOSTFILE"), "{}", err.what());
        let group = init("ring", false).expect("non-strict init");
        assert_eq!((group.rank(), group.size()), (0, 1));
        let x = Array::from_slice(&[1.5f32, -2.0], &[2]);
        let summed = group.all_sum(&x).expect("all_sum");
        assert_eq!(summed.as_slice::<f32>(), &[1.5, -2.0]);
        let gathered = group.all_gather(&x).expect("all_gather");
        assert_eq!(gathered.shape(), &[2]);
        assert_eq!(group.broadcast_bytes(b"job").expect("bytes"), b"job");
        assert!(group.any(true).expect("any") && !group.any(false).expect("any"));
        // mlx-rs's own error reporting still works after the handler swap.
        let bad = mlx_rs::ops::reshape(&x, &[3]).expect_err("bad reshape");
        assert!(!bad.what().is_empty());
    }
}
