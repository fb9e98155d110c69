//! NVIDIA nvCOMP 6 (`libnvcomp.so.6`), loaded at run time as libcuda is: the few entry
//! points of its batched low-level API that the cold tier's zstd recompressor calls
//! (`nvcomp_zstd.rs`). Nothing here needs nvCOMP at build time; a host without it gets
//! [`GpuError::NoNvcomp`], which says what to install.
//!
//! The declarations follow nvCOMP 6.0's `nvcomp/zstd.h`, `nvcomp/crc32.h` and
//! `nvcomp/shared_types.h`. Its option structs are passed by value, as the C API does.
//! nvCOMP runs on the CUDA context current on the calling thread: every call here but
//! [`Nvcomp::load`] needs the GPU's context bound first ([`crate::Gpu::bind`]).

use std::ffi::c_void;

use crate::GpuError;

/// The library's name, as the dynamic loader looks it up.
pub const LIBRARY: &str = "libnvcomp.so.6";

/// `nvcompStatus_t`; 0 is success.
pub type Status = i32;
/// `nvcompSuccess`.
pub const SUCCESS: Status = 0;

/// `nvcompBatchedZstdCompressOpts_t`: no options yet; the bytes must be zero.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ZstdOpts {
    reserved: [u8; 64],
}

impl Default for ZstdOpts {
    fn default() -> Self {
        Self { reserved: [0; 64] }
    }
}

/// `nvcompAlignmentRequirements_t`: the alignment, in bytes, of each kind of buffer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Alignments {
    /// Each input chunk.
    pub input: usize,
    /// Each output chunk.
    pub output: usize,
    /// The scratch buffer.
    pub temp: usize,
}

/// `nvcompCRC32Spec_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Crc32Spec {
    poly: u32,
    init: u32,
    ref_in: bool,
    ref_out: bool,
    xorout: u32,
    reserved: [u8; 16],
}

/// `nvcompCRC32KernelConf_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Crc32KernelConf {
    kernel_kind: i32,
    bytes_per_read: i32,
    blocks_per_msg: i32,
    reserved: [u8; 20],
}

/// `nvcompBatchedCRC32Opts_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Crc32Opts {
    spec: Crc32Spec,
    kernel_conf: Crc32KernelConf,
    reserved: [u8; 64],
}

impl Crc32Opts {
    /// CRC32C (CRC-32/ISCSI, nvCOMP's `nvcompCRC32_C`), the page checksum of the store,
    /// with the kernel configuration `conf`.
    pub fn crc32c(conf: Crc32KernelConf) -> Self {
        Self {
            spec: Crc32Spec {
                poly: 0x1EDC_6F41,
                init: 0xFFFF_FFFF,
                ref_in: true,
                ref_out: true,
                xorout: 0xFFFF_FFFF,
                reserved: [0; 16],
            },
            kernel_conf: conf,
            reserved: [0; 64],
        }
    }
}

/// `nvcompCRC32OnlySegment`: each chunk is a whole message.
const CRC32_ONLY_SEGMENT: i32 = 0;

type Stream = *mut c_void;

type GetAlignments = unsafe extern "C" fn(ZstdOpts, *mut Alignments) -> Status;
type GetTempSize =
    unsafe extern "C" fn(usize, usize, ZstdOpts, *mut usize, usize, Stream) -> Status;
type GetMaxOutput = unsafe extern "C" fn(usize, ZstdOpts, *mut usize) -> Status;
type CompressAsync = unsafe extern "C" fn(
    *const *const c_void,
    *const usize,
    usize,
    usize,
    *mut c_void,
    usize,
    *const *mut c_void,
    *mut usize,
    ZstdOpts,
    *mut Status,
    Stream,
) -> Status;
type Crc32Async = unsafe extern "C" fn(
    *const *const c_void,
    *const usize,
    usize,
    *mut u32,
    Crc32Opts,
    i32,
    *mut Status,
    Stream,
) -> Status;
type Crc32Heuristic =
    unsafe extern "C" fn(*const usize, usize, *mut Crc32KernelConf, usize, Stream) -> Status;

/// The loaded library and the entry points uzram calls.
pub struct Nvcomp {
    get_alignments: GetAlignments,
    get_temp_size: GetTempSize,
    get_max_output: GetMaxOutput,
    compress: CompressAsync,
    crc32: Crc32Async,
    crc32_heuristic: Crc32Heuristic,
    /// Keeps the entry points above mapped; dropped last.
    _library: libloading::Library,
}

impl std::fmt::Debug for Nvcomp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvcomp")
    }
}

fn failed(call: &'static str) -> impl Fn(Status) -> GpuError {
    move |status| GpuError::Nvcomp { call, status }
}

fn check(call: &'static str, status: Status) -> Result<(), GpuError> {
    if status == SUCCESS {
        Ok(())
    } else {
        Err(failed(call)(status))
    }
}

impl Nvcomp {
    /// Loads [`LIBRARY`] where the dynamic loader finds it (its cache, `LD_LIBRARY_PATH`).
    pub fn load() -> Result<Self, GpuError> {
        let no = |e: libloading::Error| GpuError::NoNvcomp(e.to_string());
        // SAFETY: loading runs the library's initializers; nvCOMP's only set up its own
        // state (it links the CUDA runtime statically and calls the driver lazily).
        let library = unsafe { libloading::Library::new(LIBRARY) }.map_err(no)?;
        // SAFETY: each symbol is read with the signature nvCOMP 6.0's headers declare for
        // it (module docs); the pointers are kept only beside `library`, which outlives
        // every call through them.
        unsafe {
            Ok(Self {
                get_alignments: *library
                    .get::<GetAlignments>(b"nvcompBatchedZstdCompressGetRequiredAlignments\0")
                    .map_err(no)?,
                get_temp_size: *library
                    .get::<GetTempSize>(b"nvcompBatchedZstdCompressGetTempSize\0")
                    .map_err(no)?,
                get_max_output: *library
                    .get::<GetMaxOutput>(b"nvcompBatchedZstdCompressGetMaxOutputChunkSize\0")
                    .map_err(no)?,
                compress: *library
                    .get::<CompressAsync>(b"nvcompBatchedZstdCompressAsync\0")
                    .map_err(no)?,
                crc32: *library
                    .get::<Crc32Async>(b"nvcompBatchedCRC32Async\0")
                    .map_err(no)?,
                crc32_heuristic: *library
                    .get::<Crc32Heuristic>(b"nvcompBatchedCRC32GetHeuristicConf\0")
                    .map_err(no)?,
                _library: library,
            })
        }
    }

    /// The alignment zstd compression needs of its buffers.
    pub fn zstd_alignments(&self) -> Result<Alignments, GpuError> {
        let mut a = Alignments::default();
        // SAFETY: `a` is a valid out-pointer for the call's duration.
        check("GetRequiredAlignments", unsafe {
            (self.get_alignments)(ZstdOpts::default(), &mut a)
        })?;
        Ok(a)
    }

    /// Scratch bytes a batch of up to `chunks` chunks of `chunk` bytes needs.
    pub fn zstd_temp_bytes(&self, chunks: usize, chunk: usize) -> Result<usize, GpuError> {
        let mut n = 0usize;
        // SAFETY: `n` is a valid out-pointer; no stream work is queued (nvCOMP's docs).
        check("CompressGetTempSize", unsafe {
            (self.get_temp_size)(
                chunks,
                chunk,
                ZstdOpts::default(),
                &mut n,
                chunks * chunk,
                std::ptr::null_mut(),
            )
        })?;
        Ok(n)
    }

    /// The most bytes a chunk of `chunk` bytes compresses to.
    pub fn zstd_max_output(&self, chunk: usize) -> Result<usize, GpuError> {
        let mut n = 0usize;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        check("CompressGetMaxOutputChunkSize", unsafe {
            (self.get_max_output)(chunk, ZstdOpts::default(), &mut n)
        })?;
        Ok(n)
    }

    /// A CRC32 kernel configuration for batches of `chunks` chunks of `chunk` bytes.
    pub fn crc32_conf(&self, chunks: usize, chunk: usize) -> Result<Crc32KernelConf, GpuError> {
        let mut conf = Crc32KernelConf::default();
        // SAFETY: with the chunk size given, the sizes array is not read and the stream
        // is ignored (nvCOMP's docs); `conf` is a valid out-pointer.
        check("CRC32GetHeuristicConf", unsafe {
            (self.crc32_heuristic)(
                std::ptr::null(),
                chunks,
                &mut conf,
                chunk,
                std::ptr::null_mut(),
            )
        })?;
        Ok(conf)
    }

    /// Queues zstd compression of `chunks` chunks on `stream`.
    ///
    /// # Safety
    /// Every pointer is device memory of the current context laid out as nvCOMP's
    /// `nvcompBatchedZstdCompressAsync` asks (arrays of `chunks` entries, chunks aligned,
    /// outputs of [`Nvcomp::zstd_max_output`] bytes, scratch of `temp_bytes`), alive and
    /// untouched until the stream has passed this work.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn zstd_compress(
        &self,
        inputs: u64,
        input_sizes: u64,
        chunk: usize,
        chunks: usize,
        temp: u64,
        temp_bytes: usize,
        outputs: u64,
        output_sizes: u64,
        statuses: u64,
        stream: *mut c_void,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract above.
        check("ZstdCompressAsync", unsafe {
            (self.compress)(
                inputs as *const *const c_void,
                input_sizes as *const usize,
                chunk,
                chunks,
                temp as *mut c_void,
                temp_bytes,
                outputs as *const *mut c_void,
                output_sizes as *mut usize,
                ZstdOpts::default(),
                statuses as *mut Status,
                stream,
            )
        })
    }

    /// Queues the CRC32C of `chunks` chunks on `stream`.
    ///
    /// # Safety
    /// `inputs` and `input_sizes` are device arrays of `chunks` entries naming device
    /// memory; `crcs` has room for `chunks` words; all alive until the stream has passed
    /// this work.
    pub unsafe fn crc32c(
        &self,
        inputs: u64,
        input_sizes: u64,
        chunks: usize,
        crcs: u64,
        conf: Crc32KernelConf,
        stream: *mut c_void,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's contract above.
        check("CRC32Async", unsafe {
            (self.crc32)(
                inputs as *const *const c_void,
                input_sizes as *const usize,
                chunks,
                crcs as *mut u32,
                Crc32Opts::crc32c(conf),
                CRC32_ONLY_SEGMENT,
                std::ptr::null_mut(),
                stream,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_structs_have_the_c_layout() {
        // nvCOMP 6.0's headers: 64 reserved bytes; spec 32 (a u32 after two bools is
        // aligned to 4); kernel configuration 32; CRC options 128.
        assert_eq!(std::mem::size_of::<ZstdOpts>(), 64);
        assert_eq!(std::mem::size_of::<Crc32Spec>(), 32);
        assert_eq!(std::mem::offset_of!(Crc32Spec, xorout), 12);
        assert_eq!(std::mem::size_of::<Crc32KernelConf>(), 32);
        assert_eq!(std::mem::size_of::<Crc32Opts>(), 128);
        assert_eq!(std::mem::size_of::<Alignments>(), 24);
    }

    #[test]
    fn a_host_without_nvcomp_is_told_what_to_install() {
        match Nvcomp::load() {
            Ok(_) => eprintln!("nvCOMP is installed here; nothing to check"),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains(LIBRARY), "{text}");
                assert!(text.contains("nvCOMP"), "{text}");
                assert_eq!(e.kind(), crate::ErrorKind::Unavailable);
            }
        }
    }
}
