//! [`GpuDictLz4`]: LZ4 with an external dictionary on one GPU, behind uzram-core's slot
//! seam, one slot of pages: for the cold tier's recompressor. The device's trained
//! dictionary (up to [`MAX_DICT_BYTES`]) is every block's prefix, so matches reach into it
//! and pages that share little with themselves still compress (on the mixed-swap corpus a
//! 32 KiB dictionary stores about 0.85 of plain LZ4's payload: `scripts/gpu-dict-host-check`).
//! The blocks are standard LZ4, which any decoder given the dictionary as its prefix
//! decodes (lz4_flex's `decompress_into_with_dict`, liblz4's
//! `LZ4_decompress_safe_usingDict`).
//!
//! No check kernel runs after the compression, unlike [`crate::GpuSlots`]: the store
//! decodes every block on the CPU, with the dictionary, and compares it with the page
//! before it takes it, so nothing is trusted because the device wrote it. The device also
//! computes the CRC32C of each page as it read it, which the store compares with the
//! page's own checksum.
//!
//! One submission: the staged pages are copied in, `uzram_lz4_dict` compresses each into a
//! 4096-byte place of its own (`kernels/lz4.cu`), and the sizes, checksums and blocks come
//! back to pinned host memory. [`GpuDictLz4::load_dictionary`] uploads a dictionary and
//! builds its hash chains on the device (`uzram_lz4_dict_chains`) once, so that no page
//! pays for them.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::result;
use cudarc::driver::sys::{CUdeviceptr, CUfunction};
use uzram_core::batch::{
    meta_bytes, BackendError, BackendMemory, SlotBackend, SlotOutput, SIZE_RAW,
};
use uzram_core::codec::Algorithm;
use uzram_core::PAGE_SIZE;

use crate::driver::{DevBuf, Event, Gpu, HostBuf, Kernel, PinnedWords, Stream};
use crate::slots::{may_submit, only_slot, queued, slot_output};
use crate::{to_backend_error, GpuError};

/// The longest dictionary the kernel takes (its `DICT_MAX_BYTES`): with it every offset
/// into the dictionary, at most this plus a page, fits LZ4's 16 bits.
pub const MAX_DICT_BYTES: usize = 32768;

/// Entries of the dictionary's hash-head table (the kernel's `1 << DICT_HASH_LOG`).
const DICT_HEAD_ENTRIES: usize = 1 << 14;

/// Bytes of the dictionary's device buffer (the kernel's `DICT_BUF_BYTES`): the kernel
/// measures matches with word reads that may pass the dictionary's end.
const DICT_BUF_BYTES: usize = MAX_DICT_BYTES + 16;

/// Threads of a block of the compression kernel (its `DICT_THREADS`, its launch bound):
/// four warps share a page.
const DICT_THREADS: u32 = 128;
/// Threads of the chains kernel's one block: one warp (its launch bound).
const CHAINS_THREADS: u32 = 32;

/// LZ4 with the device's dictionary on one GPU, one slot; see the module docs.
pub struct GpuDictLz4 {
    gpu: Arc<Gpu>,
    stream: Stream,
    /// Recorded around the kernel, for its time in the stats.
    start: Event,
    kernel_done: Event,
    /// Recorded after a submission's last copy; waited for by sleeping, not spinning.
    done: Event,
    pages: usize,
    input: PinnedWords,
    device: Device,
    host: Mutex<Host>,
    counters: Counters,
}

/// The device's buffers.
struct Device {
    input: DevBuf,
    dict: DevBuf,
    dict_head: DevBuf,
    dict_prev: DevBuf,
    blocks: DevBuf,
    sizes: DevBuf,
    crcs: DevBuf,
}

/// What comes back, the dictionary's staging, and the submission in flight.
struct Host {
    blocks: HostBuf,
    sizes: HostBuf,
    crcs: HostBuf,
    dict: HostBuf,
    /// Bytes of the loaded dictionary; 0 before one is loaded.
    dict_len: usize,
    meta: Vec<u8>,
    /// Pages and raw limit of the submission in flight.
    submitted: Option<(usize, usize)>,
}

#[derive(Default)]
struct Counters {
    pages: AtomicU64,
    raw_pages: AtomicU64,
    block_bytes: AtomicU64,
    kernel_ns: AtomicU64,
    /// The loaded dictionary's length, for `stats`, which must not wait on the host lock (a
    /// slot's completion holds it across the GPU's wait and the installs).
    dict_bytes: AtomicU64,
}

/// Refuses a dictionary the kernel cannot take: empty, or longer than [`MAX_DICT_BYTES`].
fn check_dictionary_len(len: usize) -> Result<(), GpuError> {
    if len == 0 || len > MAX_DICT_BYTES {
        return Err(GpuError::Config(format!(
            "a dictionary of {len} bytes (1..={MAX_DICT_BYTES})"
        )));
    }
    Ok(())
}

fn check_slot_pages(pages: usize) -> Result<(), GpuError> {
    if pages == 0 || pages > 1 << 16 {
        return Err(GpuError::Config(format!(
            "a dictionary LZ4 slot of {pages} pages (1..=65536)"
        )));
    }
    Ok(())
}

impl GpuDictLz4 {
    /// Opens GPU `ordinal` with the embedded kernels and sets up a slot of `slot_pages`
    /// pages. No dictionary is loaded yet ([`GpuDictLz4::load_dictionary`]). Errors of kind
    /// [`crate::ErrorKind::Unavailable`] mean there is no GPU to use.
    pub fn new(ordinal: usize, slot_pages: usize) -> Result<Self, GpuError> {
        check_slot_pages(slot_pages)?;
        let pages = slot_pages;
        let gpu = Gpu::open(ordinal)?;
        for (k, threads) in [
            (Kernel::Dict, DICT_THREADS),
            (Kernel::DictChains, CHAINS_THREADS),
        ] {
            if gpu.function(k).is_none() {
                return Err(GpuError::Config(format!("the PTX lacks {}", k.entry())));
            }
            // The kernels split their page by their own block size: launched with another,
            // they would compress parts of pages.
            if gpu.declared_threads(k) != Some(threads) {
                return Err(GpuError::Config(format!(
                    "the module's {} takes {:?} threads a block; this build launches {threads}",
                    k.entry(),
                    gpu.declared_threads(k)
                )));
            }
        }
        let bytes = pages * PAGE_SIZE;
        let device = Device {
            input: DevBuf::new(&gpu, bytes)?,
            dict: DevBuf::new(&gpu, DICT_BUF_BYTES)?,
            dict_head: DevBuf::new(&gpu, DICT_HEAD_ENTRIES * 2)?,
            dict_prev: DevBuf::new(&gpu, MAX_DICT_BYTES * 2)?,
            blocks: DevBuf::new(&gpu, bytes)?,
            sizes: DevBuf::new(&gpu, pages * 4)?,
            crcs: DevBuf::new(&gpu, pages * 4)?,
        };
        let host = Host {
            blocks: HostBuf::new(&gpu, bytes)?,
            sizes: HostBuf::new(&gpu, pages * 4)?,
            crcs: HostBuf::new(&gpu, pages * 4)?,
            dict: HostBuf::new(&gpu, MAX_DICT_BYTES)?,
            dict_len: 0,
            meta: vec![0; meta_bytes(pages)],
            submitted: None,
        };
        Ok(Self {
            input: PinnedWords::new(&gpu, bytes / 8)?,
            stream: Stream::new(&gpu)?,
            start: Event::new(&gpu)?,
            kernel_done: Event::new(&gpu)?,
            done: Event::blocking(&gpu)?,
            gpu,
            pages,
            device,
            host: Mutex::new(host),
            counters: Counters::default(),
        })
    }

    /// The most pinned host memory a slot of `pages` pages takes (staging, blocks, sizes,
    /// checksums and the dictionary's staging), known before a GPU is opened.
    pub const fn pinned_bytes_for(pages: usize) -> u64 {
        (pages * (2 * PAGE_SIZE + 8) + MAX_DICT_BYTES) as u64
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        self.gpu.name()
    }

    /// Bytes of the loaded dictionary (0: none yet).
    pub fn dictionary_len(&self) -> usize {
        self.lock().dict_len
    }

    /// Uploads `dict` as the prefix of every later block and builds its hash chains on the
    /// device; returns once they are in place. Refuses an empty dictionary, one longer than
    /// [`MAX_DICT_BYTES`], or a change while a submission is in flight (caller bugs). After
    /// a failure no dictionary is loaded.
    pub fn load_dictionary(&self, dict: &[u8]) -> Result<(), GpuError> {
        check_dictionary_len(dict.len())?;
        let mut host = self.lock();
        if host.submitted.is_some() {
            return Err(GpuError::Config(
                "a dictionary cannot change while a submission is in flight".into(),
            ));
        }
        host.dict_len = 0;
        self.counters.dict_bytes.store(0, Relaxed);
        host.dict.as_mut_slice()[..dict.len()].copy_from_slice(dict);
        let f = self.function(Kernel::DictChains)?;
        let d = &self.device;
        let mut dict_ptr = d.dict.ptr();
        let mut len = dict.len() as u32;
        let mut head = d.dict_head.ptr();
        let mut prev = d.dict_prev.ptr();
        let mut params: [*mut c_void; 4] = [
            (&mut dict_ptr as *mut CUdeviceptr).cast(),
            (&mut len as *mut u32).cast(),
            (&mut head as *mut CUdeviceptr).cast(),
            (&mut prev as *mut CUdeviceptr).cast(),
        ];
        // SAFETY: the staging is pinned, holds the dictionary's bytes and is not written
        // again before the synchronize below (the lock is held); the device buffers were
        // sized for MAX_DICT_BYTES, which the length is at most (checked above). (The bytes
        // past it in the device buffer are left as they are: the kernel's word reads there
        // feed only compares it cuts at the dictionary's end.) The chains
        // kernel's signature is (const u8*, u32, u16*, u16*), which `params` matches with
        // locals that outlive the launch call.
        let queued = unsafe {
            self.stream
                .copy_to_device(d.dict.ptr(), host.dict.as_slice().as_ptr(), dict.len())
                .and_then(|()| launch(&self.gpu, &self.stream, f, 1, CHAINS_THREADS, &mut params))
        };
        // Whatever was queued finishes before the staging or the tables are used again.
        let synced = self.stream.synchronize();
        queued.and(synced)?;
        host.dict_len = dict.len();
        self.counters.dict_bytes.store(dict.len() as u64, Relaxed);
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Host> {
        self.host.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn function(&self, k: Kernel) -> Result<CUfunction, GpuError> {
        self.gpu
            .function(k)
            .ok_or_else(|| GpuError::Config(format!("the loaded module has no {}", k.entry())))
    }

    /// Queues the copy in, the compression and the copies out of `pages` pages.
    fn queue(&self, host: &Host, pages: usize, limit: usize) -> Result<(), GpuError> {
        let f = self.function(Kernel::Dict)?;
        let d = &self.device;
        let s = &self.stream;
        let mut input = d.input.ptr();
        let mut dict = d.dict.ptr();
        let mut head = d.dict_head.ptr();
        let mut prev = d.dict_prev.ptr();
        let mut dict_len = host.dict_len as u32;
        let mut blocks = d.blocks.ptr();
        let mut sizes = d.sizes.ptr();
        let mut crcs = d.crcs.ptr();
        let mut npages = pages as u32;
        let mut limit = limit.min(PAGE_SIZE) as u32;
        let mut params: [*mut c_void; 10] = [
            (&mut input as *mut CUdeviceptr).cast(),
            (&mut dict as *mut CUdeviceptr).cast(),
            (&mut head as *mut CUdeviceptr).cast(),
            (&mut prev as *mut CUdeviceptr).cast(),
            (&mut dict_len as *mut u32).cast(),
            (&mut blocks as *mut CUdeviceptr).cast(),
            (&mut sizes as *mut CUdeviceptr).cast(),
            (&mut crcs as *mut CUdeviceptr).cast(),
            (&mut npages as *mut u32).cast(),
            (&mut limit as *mut u32).cast(),
        ];
        // SAFETY: every buffer was sized for `self.pages >= pages` pages (the dictionary's
        // for MAX_DICT_BYTES) in `new` and lives as long as `self`; the host buffers are
        // pinned and not read before `complete` waits for `done`, and the staged input is
        // not written by the caller between `submit` and `complete` (the seam's contract).
        // The kernel's signature is (const uint4*, const u8*, const u16*, const u16*, u32,
        // uint4*, u32*, u32*, u32, u32), which `params` matches with locals that outlive
        // the launch call.
        unsafe {
            s.copy_to_device(
                d.input.ptr(),
                self.input.as_copy_source(),
                pages * PAGE_SIZE,
            )?;
            self.start.record(s)?;
            launch(&self.gpu, s, f, pages as u32, DICT_THREADS, &mut params)?;
            self.kernel_done.record(s)?;
            s.copy_into_host(&host.sizes, d.sizes.ptr(), pages * 4)?;
            s.copy_into_host(&host.crcs, d.crcs.ptr(), pages * 4)?;
            s.copy_into_host(&host.blocks, d.blocks.ptr(), pages * PAGE_SIZE)?;
        }
        self.done.record(s)
    }
}

/// Writes the slot format's meta words for `pages` pages into `meta` from the kernel's
/// sizes and checksums (little-endian u32s; blocks a page apart; a size of 0: raw); a size
/// the kernel cannot have written (not below `limit`) is an error.
fn encode(
    sizes: &[u8],
    crcs: &[u8],
    pages: usize,
    limit: usize,
    meta: &mut [u8],
) -> Result<(), GpuError> {
    let word = |buf: &[u8], k: usize| {
        u32::from_le_bytes([buf[4 * k], buf[4 * k + 1], buf[4 * k + 2], buf[4 * k + 3]])
    };
    let mut put = |i: usize, v: u32| meta[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    for k in 0..pages {
        let size = word(sizes, k);
        if size != SIZE_RAW && size as usize >= limit.min(PAGE_SIZE) {
            return Err(GpuError::BadLength { page: k, len: size });
        }
        put(k, size);
        put(pages + k, (k * PAGE_SIZE) as u32);
        put(2 * pages + 1 + k, word(crcs, k));
    }
    put(2 * pages, (pages * PAGE_SIZE) as u32);
    Ok(())
}

/// Launches `f` over `grid` blocks of `threads` (the kernels loop over their pages).
///
/// # Safety
/// `params` must match `f`'s signature and name device memory of `gpu`'s context that lives
/// until the stream has run the launch.
unsafe fn launch(
    gpu: &Gpu,
    stream: &Stream,
    f: CUfunction,
    grid: u32,
    threads: u32,
    params: &mut [*mut c_void],
) -> Result<(), GpuError> {
    gpu.bind()?;
    let grid = grid.clamp(1, 1 << 30);
    // SAFETY: as the caller guarantees; static shared memory only.
    unsafe { result::launch_kernel(f, (grid, 1, 1), (threads, 1, 1), 0, stream.raw(), params) }
        .map_err(GpuError::driver("cuLaunchKernel"))
}

impl Drop for GpuDictLz4 {
    fn drop(&mut self) {
        // Work in flight reads and writes the buffers dropped after this.
        let _ = self.stream.synchronize();
    }
}

impl SlotBackend for GpuDictLz4 {
    fn name(&self) -> &'static str {
        "gpu-lz4-dict"
    }

    /// LZ4 blocks, which decode only with the dictionary as their prefix.
    fn algorithm(&self) -> Algorithm {
        Algorithm::Lz4
    }

    fn slots(&self) -> usize {
        1
    }

    fn slot_pages(&self) -> usize {
        self.pages
    }

    fn input(&self, slot: usize) -> &[AtomicU64] {
        if slot == 0 {
            self.input.words()
        } else {
            &[]
        }
    }

    fn submit(&self, slot: usize, pages: usize, limit: usize) -> Result<(), BackendError> {
        only_slot(slot)?;
        let mut host = self.lock();
        may_submit(slot, pages, self.pages, host.submitted.is_some())?;
        if host.dict_len == 0 {
            return Err(to_backend_error(&GpuError::Config(
                "no dictionary is loaded (GpuDictLz4::load_dictionary)".into(),
            )));
        }
        queued(self.queue(&host, pages, limit), &self.stream)?;
        host.submitted = Some((pages, limit));
        Ok(())
    }

    fn complete(
        &self,
        slot: usize,
        install: &mut dyn FnMut(&SlotOutput<'_>),
    ) -> Result<(), BackendError> {
        only_slot(slot)?;
        let mut host = self.lock();
        let Some((pages, limit)) = host.submitted.take() else {
            return Err(to_backend_error(&GpuError::Config(
                "the slot has nothing submitted".into(),
            )));
        };
        let waited = self.done.synchronize().and_then(|()| {
            let h = &mut *host;
            encode(
                h.sizes.as_slice(),
                h.crcs.as_slice(),
                pages,
                limit,
                &mut h.meta,
            )
        });
        if let Err(e) = waited {
            // Whatever failed, nothing may still run on the slot when it is reused.
            let _ = self.stream.synchronize();
            return Err(to_backend_error(&e));
        }
        let host = &*host;
        let out = slot_output(pages, &host.meta, host.blocks.as_slice(), limit)?;
        let c = &self.counters;
        c.pages.fetch_add(pages as u64, Relaxed);
        let sizes = host.sizes.as_slice();
        let (mut raw, mut bytes) = (0u64, 0u64);
        for w in sizes[..pages * 4].chunks_exact(4) {
            match u32::from_le_bytes([w[0], w[1], w[2], w[3]]) {
                SIZE_RAW => raw += 1,
                n => bytes += u64::from(n),
            }
        }
        c.raw_pages.fetch_add(raw, Relaxed);
        c.block_bytes.fetch_add(bytes, Relaxed);
        if let Ok(ms) = self.start.elapsed_ms(&self.kernel_done) {
            c.kernel_ns.fetch_add((f64::from(ms) * 1e6) as u64, Relaxed);
        }
        install(&out);
        Ok(())
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let c = &self.counters;
        vec![
            ("gpu_dict_pages", c.pages.load(Relaxed)),
            ("gpu_dict_raw_pages", c.raw_pages.load(Relaxed)),
            ("gpu_dict_block_bytes", c.block_bytes.load(Relaxed)),
            ("gpu_dict_kernel_us", c.kernel_ns.load(Relaxed) / 1000),
            ("gpu_dict_bytes", c.dict_bytes.load(Relaxed)),
        ]
    }

    fn memory(&self) -> BackendMemory {
        let pages = self.pages as u64;
        let page = PAGE_SIZE as u64;
        BackendMemory {
            pinned_host_bytes: Self::pinned_bytes_for(self.pages),
            host_bytes: meta_bytes(self.pages) as u64,
            device_bytes: pages * (2 * page + 8)
                + (DICT_BUF_BYTES + 2 * MAX_DICT_BYTES + 2 * DICT_HEAD_ENTRIES) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use uzram_core::batch::PageResult;

    use super::*;
    use crate::ErrorKind;

    fn words(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn dictionaries_the_kernel_cannot_take_are_caller_bugs() {
        for bad in [0, MAX_DICT_BYTES + 1, 1 << 20] {
            let e = check_dictionary_len(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Usage, "{bad}: {e}");
        }
        for good in [1, 4, 4096, MAX_DICT_BYTES] {
            check_dictionary_len(good).unwrap();
        }
        assert_eq!(check_slot_pages(0).unwrap_err().kind(), ErrorKind::Usage);
        assert_eq!(
            check_slot_pages((1 << 16) + 1).unwrap_err().kind(),
            ErrorKind::Usage
        );
        assert_eq!(
            GpuDictLz4::new(0, 0).err().map(|e| e.kind()),
            Some(ErrorKind::Usage)
        );
    }

    #[test]
    fn the_kernels_constants_are_this_files() {
        // The tables are sized here from the kernel's constants.
        let src = crate::ptx::SOURCE;
        assert!(src.contains(&format!("#define DICT_MAX_BYTES {MAX_DICT_BYTES}u\n")));
        assert!(src.contains("#define DICT_BUF_BYTES (DICT_MAX_BYTES + 16u)\n"));
        assert_eq!(DICT_BUF_BYTES, MAX_DICT_BYTES + 16);
        assert!(src.contains(&format!("#define DICT_THREADS {DICT_THREADS}u\n")));
        assert!(src.contains(&format!(
            "#define DICT_HASH_LOG {}u\n",
            DICT_HEAD_ENTRIES.trailing_zeros()
        )));
    }

    #[test]
    fn what_the_kernel_returns_becomes_the_slot_format() {
        let (pages, limit) = (3, 3000);
        let sizes = words(&[100, SIZE_RAW, 2999]);
        let crcs = words(&[0xa, 0xb, 0xc]);
        let mut meta = vec![0u8; meta_bytes(pages)];
        encode(&sizes, &crcs, pages, limit, &mut meta).unwrap();
        let packed = vec![7u8; pages * PAGE_SIZE];
        let out = SlotOutput::new(pages, &meta, &packed, limit).unwrap();
        assert_eq!(out.page(0), Ok(PageResult::Compressed(&packed[..100])));
        assert_eq!(out.page(1), Ok(PageResult::Raw));
        assert_eq!(
            out.page(2),
            Ok(PageResult::Compressed(
                &packed[2 * PAGE_SIZE..2 * PAGE_SIZE + 2999]
            ))
        );
        assert_eq!(out.checksum(2), Ok(0xc));
        // A block as long as the limit is one the kernel cannot have written.
        let sizes = words(&[100, 3000, 5]);
        let e = encode(&sizes, &crcs, pages, limit, &mut meta).unwrap_err();
        assert!(
            matches!(e, GpuError::BadLength { page: 1, len: 3000 }),
            "{e}"
        );
    }

    #[test]
    fn no_gpu_is_reported_not_panicked() {
        match GpuDictLz4::new(0, 64) {
            Ok(b) => {
                eprintln!("a GPU is here; checking the dictionary rules");
                let e = b.submit(0, 1, PAGE_SIZE).unwrap_err();
                assert!(e.message.contains("no dictionary"), "{e}");
                assert_eq!(b.load_dictionary(&[]).unwrap_err().kind(), ErrorKind::Usage);
                assert_eq!(
                    b.load_dictionary(&vec![1; MAX_DICT_BYTES + 1])
                        .unwrap_err()
                        .kind(),
                    ErrorKind::Usage
                );
                b.load_dictionary(b"a dictionary").unwrap();
                assert_eq!(b.dictionary_len(), 12);
            }
            Err(e) => {
                eprintln!("no GPU here ({e}); checking the error is a clean fallback");
                assert_eq!(e.kind(), ErrorKind::Unavailable);
            }
        }
    }
}
