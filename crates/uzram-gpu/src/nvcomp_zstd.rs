//! [`NvcompZstd`]: NVIDIA nvCOMP's batched zstd behind uzram-core's slot seam, one slot of
//! pages: the cold tier's `zstd-gpu` recompressor. Its frames are standard zstd, which the
//! store decodes on the CPU as it decodes the CPU's zstd; the store installs a frame only
//! after decoding it to the very page (`store/recompress.rs`), so nothing here is trusted
//! because the device wrote it.
//!
//! One submission: the staged pages are copied to the device, nvCOMP computes each page's
//! CRC32C there (what the device read, compared with the page's own checksum before a
//! frame is taken) and compresses them, each frame into a place of its own of the most
//! bytes a page can take, and the sizes, statuses, checksums and frames come back to
//! pinned host memory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use uzram_core::batch::{
    meta_bytes, BackendError, BackendMemory, SlotBackend, SlotOutput, SIZE_RAW, SIZE_REJECTED,
};
use uzram_core::codec::Algorithm;
use uzram_core::PAGE_SIZE;

use crate::driver::{DevBuf, Event, Gpu, HostBuf, PinnedWords, Stream};
use crate::nvcomp::{Crc32KernelConf, Nvcomp, SUCCESS};
use crate::slots::{may_submit, only_slot, queued, slot_output};
use crate::{to_backend_error, GpuError};

/// nvCOMP's batched zstd on one GPU, one slot; see the module docs.
pub struct NvcompZstd {
    gpu: Arc<Gpu>,
    stream: Stream,
    /// Recorded after a submission's last copy; waited for by sleeping, not spinning.
    done: Event,
    pages: usize,
    /// Bytes between two pages' frames: the most a page compresses to, aligned.
    stride: usize,
    temp_bytes: usize,
    crc_conf: Crc32KernelConf,
    input: PinnedWords,
    device: Device,
    host: Mutex<Host>,
    /// Pages nvCOMP could not compress (a status other than success, or a frame longer
    /// than its own bound): left as they were.
    failed_pages: AtomicU64,
    /// The most bytes nvCOMP says a page compresses to.
    max: usize,
    /// Last, so that the library (with its CUDA runtime) outlives every buffer and stream.
    nvcomp: Nvcomp,
}

/// The device's buffers.
struct Device {
    input: DevBuf,
    frames: DevBuf,
    input_ptrs: DevBuf,
    frame_ptrs: DevBuf,
    input_sizes: DevBuf,
    frame_sizes: DevBuf,
    statuses: DevBuf,
    crcs: DevBuf,
    temp: DevBuf,
}

/// What comes back, and the submission in flight.
struct Host {
    frames: HostBuf,
    sizes: HostBuf,
    statuses: HostBuf,
    crcs: HostBuf,
    meta: Vec<u8>,
    /// Pages and raw limit of the submission in flight.
    submitted: Option<(usize, usize)>,
}

/// The most alignment nvCOMP may ask of a buffer (cuMemAlloc's is 256 at least).
const MAX_ALIGNMENT: usize = 256;

/// The most bytes between two frames: nvCOMP's bound for a page is a little over a page
/// (zstd's own is 4174 bytes); twice a page bounds the memory a slot is counted for.
const MAX_STRIDE: usize = 2 * PAGE_SIZE;

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to.max(1)) * to.max(1)
}

impl NvcompZstd {
    /// Loads nvCOMP and sets up a slot of `pages` pages on GPU `ordinal`.
    pub fn new(ordinal: usize, pages: usize) -> Result<Self, GpuError> {
        if pages == 0 || pages > 1 << 16 {
            return Err(GpuError::Config(format!(
                "an nvCOMP slot of {pages} pages (1..=65536)"
            )));
        }
        let nvcomp = Nvcomp::load()?;
        let gpu = Gpu::open_context(ordinal)?;
        gpu.bind()?;
        let align = nvcomp.zstd_alignments()?;
        // Pages lie 4 KiB apart, frames `stride` apart, and every buffer starts where
        // cuMemAlloc puts it (256-byte aligned at least).
        if [align.input, align.output, align.temp]
            .iter()
            .any(|&a| a > MAX_ALIGNMENT || !PAGE_SIZE.is_multiple_of(a.max(1)))
        {
            return Err(GpuError::Config(format!(
                "nvCOMP asks alignments {align:?}; uzram's buffers give at most {MAX_ALIGNMENT}"
            )));
        }
        let max = nvcomp.zstd_max_output(PAGE_SIZE)?;
        let stride = round_up(max, align.output.max(8));
        if stride > MAX_STRIDE {
            return Err(GpuError::Config(format!(
                "nvCOMP says a page compresses to up to {max} bytes (uzram allows {MAX_STRIDE})"
            )));
        }
        let temp_bytes = nvcomp.zstd_temp_bytes(pages, PAGE_SIZE)?;
        let crc_conf = nvcomp.crc32_conf(pages, PAGE_SIZE)?;
        if u32::try_from(pages * stride).is_err() {
            return Err(GpuError::Config(format!(
                "nvCOMP frames of up to {max} bytes: {pages} pages' do not fit a slot"
            )));
        }
        let stream = Stream::new(&gpu)?;
        let device = Device {
            input: DevBuf::new(&gpu, pages * PAGE_SIZE)?,
            frames: DevBuf::new(&gpu, pages * stride)?,
            input_ptrs: DevBuf::new(&gpu, pages * 8)?,
            frame_ptrs: DevBuf::new(&gpu, pages * 8)?,
            input_sizes: DevBuf::new(&gpu, pages * 8)?,
            frame_sizes: DevBuf::new(&gpu, pages * 8)?,
            statuses: DevBuf::new(&gpu, pages * 4)?,
            crcs: DevBuf::new(&gpu, pages * 4)?,
            temp: DevBuf::new(&gpu, round_up(temp_bytes, align.temp.max(8)).max(8))?,
        };
        // The pointer and size arrays never change: written once here.
        let words = |f: &dyn Fn(usize) -> u64| -> Result<HostBuf, GpuError> {
            let mut buf = HostBuf::new(&gpu, pages * 8)?;
            for (k, w) in buf.as_mut_slice().chunks_exact_mut(8).enumerate() {
                w.copy_from_slice(&f(k).to_le_bytes());
            }
            Ok(buf)
        };
        let arrays = [
            (
                &device.input_ptrs,
                words(&|k| device.input.ptr() + (k * PAGE_SIZE) as u64)?,
            ),
            (
                &device.frame_ptrs,
                words(&|k| device.frames.ptr() + (k * stride) as u64)?,
            ),
            (&device.input_sizes, words(&|_| PAGE_SIZE as u64)?),
        ];
        let mut copied = Ok(());
        for (dst, src) in &arrays {
            // SAFETY: `dst` has `pages * 8` bytes, as `src` (pinned) has, and `src` lives
            // until the synchronize below, which comes whether or not a copy failed.
            copied = copied.and_then(|()| unsafe {
                stream.copy_to_device(dst.ptr(), src.as_slice().as_ptr(), pages * 8)
            });
        }
        let synced = stream.synchronize();
        drop(arrays);
        copied.and(synced)?;
        let host = Host {
            frames: HostBuf::new(&gpu, pages * stride)?,
            sizes: HostBuf::new(&gpu, pages * 8)?,
            statuses: HostBuf::new(&gpu, pages * 4)?,
            crcs: HostBuf::new(&gpu, pages * 4)?,
            meta: vec![0; meta_bytes(pages)],
            submitted: None,
        };
        Ok(Self {
            input: PinnedWords::new(&gpu, pages * PAGE_SIZE / 8)?,
            done: Event::blocking(&gpu)?,
            nvcomp,
            gpu,
            stream,
            pages,
            stride,
            temp_bytes,
            crc_conf,
            device,
            host: Mutex::new(host),
            failed_pages: AtomicU64::new(0),
            max,
        })
    }

    /// The most pinned host memory a slot of `pages` pages takes (staging, frames,
    /// sizes, statuses and checksums), known before nvCOMP is loaded.
    pub const fn pinned_bytes_for(pages: usize) -> u64 {
        (pages * (PAGE_SIZE + MAX_STRIDE + 16)) as u64
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        self.gpu.name()
    }

    fn lock(&self) -> MutexGuard<'_, Host> {
        self.host.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues the copy in, the checksums, the compression and the copies out of `pages`.
    fn queue(&self, host: &Host, pages: usize) -> Result<(), GpuError> {
        let d = &self.device;
        let s = &self.stream;
        // SAFETY: every buffer was sized for `self.pages >= pages` pages in `new` and lives
        // as long as `self`; the host buffers are pinned, are not read before `complete`
        // synchronizes the stream, and the staged input is not written by the caller
        // between `submit` and `complete` (the seam's contract). The device arrays name
        // the device buffers above.
        unsafe {
            s.copy_to_device(
                d.input.ptr(),
                self.input.as_copy_source(),
                pages * PAGE_SIZE,
            )?;
            let stream = s.raw().cast();
            self.nvcomp.crc32c(
                d.input_ptrs.ptr(),
                d.input_sizes.ptr(),
                pages,
                d.crcs.ptr(),
                self.crc_conf,
                stream,
            )?;
            self.nvcomp.zstd_compress(
                d.input_ptrs.ptr(),
                d.input_sizes.ptr(),
                PAGE_SIZE,
                pages,
                d.temp.ptr(),
                self.temp_bytes,
                d.frame_ptrs.ptr(),
                d.frame_sizes.ptr(),
                d.statuses.ptr(),
                stream,
            )?;
            s.copy_into_host(&host.sizes, d.frame_sizes.ptr(), pages * 8)?;
            s.copy_into_host(&host.statuses, d.statuses.ptr(), pages * 4)?;
            s.copy_into_host(&host.crcs, d.crcs.ptr(), pages * 4)?;
            s.copy_into_host(&host.frames, d.frames.ptr(), pages * self.stride)?;
        }
        self.done.record(s)
    }

    /// Fills `host.meta` in the slot format from what came back; `limit`: the raw
    /// threshold. A page nvCOMP could not compress is left as it was (rejected), counted
    /// and logged once; a batch of which it compressed none is an error, so that a pass
    /// does not flag every page tried while nvCOMP is broken.
    fn fill_meta(&self, host: &mut Host, pages: usize, limit: usize) -> Result<(), GpuError> {
        let back = Returned {
            sizes: host.sizes.as_slice(),
            statuses: host.statuses.as_slice(),
            crcs: host.crcs.as_slice(),
        };
        let Some(failed) = back.encode(pages, self.stride, self.max, limit, &mut host.meta) else {
            return Ok(());
        };
        self.failed_pages.fetch_add(failed.pages as u64, Relaxed);
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Relaxed) {
            tracing::warn!(
                failed = failed.pages,
                pages,
                page = failed.first,
                status = failed.status,
                size = failed.size,
                bound = self.max,
                "nvCOMP did not compress some pages (status, or a frame past its own bound): \
                 left as they were"
            );
        }
        if failed.pages == pages {
            return Err(GpuError::Nvcomp {
                call: "ZstdCompressAsync (every page of the batch)",
                status: failed.status,
            });
        }
        Ok(())
    }
}

/// What a submission copied back: per page a `usize` frame size, an `i32` status and a
/// `u32` CRC32C, little-endian.
struct Returned<'a> {
    sizes: &'a [u8],
    statuses: &'a [u8],
    crcs: &'a [u8],
}

/// Pages of a batch nvCOMP did not compress, and the first of them.
#[derive(Debug, PartialEq, Eq)]
struct Failed {
    pages: usize,
    first: usize,
    status: i32,
    size: u64,
}

impl Returned<'_> {
    fn word(buf: &[u8], k: usize, width: usize) -> u64 {
        let mut w = [0u8; 8];
        w[..width].copy_from_slice(&buf[k * width..(k + 1) * width]);
        u64::from_le_bytes(w)
    }

    /// Writes the slot format's meta words for `pages` pages into `meta` (frames `stride`
    /// apart, none longer than `max`, raw from `limit` bytes); the pages it could not
    /// take, if any.
    fn encode(
        &self,
        pages: usize,
        stride: usize,
        max: usize,
        limit: usize,
        meta: &mut [u8],
    ) -> Option<Failed> {
        let mut put = |i: usize, v: u32| meta[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        let mut failed: Option<Failed> = None;
        for k in 0..pages {
            let size = Self::word(self.sizes, k, 8);
            let status = Self::word(self.statuses, k, 4) as u32 as i32;
            let size_word = match size as usize {
                n if status != SUCCESS || n > max => {
                    let f = failed.get_or_insert(Failed {
                        pages: 0,
                        first: k,
                        status,
                        size,
                    });
                    f.pages += 1;
                    SIZE_REJECTED
                }
                n if n >= limit.min(PAGE_SIZE) => SIZE_RAW,
                n => n as u32,
            };
            put(k, size_word);
            put(pages + k, (k * stride) as u32);
            put(2 * pages + 1 + k, Self::word(self.crcs, k, 4) as u32);
        }
        put(2 * pages, (pages * stride) as u32);
        failed
    }
}

impl Drop for NvcompZstd {
    fn drop(&mut self) {
        // Work in flight reads and writes the buffers dropped after this.
        let _ = self.stream.synchronize();
    }
}

impl SlotBackend for NvcompZstd {
    fn name(&self) -> &'static str {
        "nvcomp-zstd"
    }

    /// zstd frames; nvCOMP's zstd has no levels, so the level is zstd's "default" (0).
    fn algorithm(&self) -> Algorithm {
        Algorithm::Zstd { level: 0 }
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
        queued(self.queue(&host, pages), &self.stream)?;
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
        self.done
            .synchronize()
            .and_then(|()| self.fill_meta(&mut host, pages, limit))
            .map_err(|e| {
                // Whatever failed, nothing may still run on the slot when it is reused.
                let _ = self.stream.synchronize();
                to_backend_error(&e)
            })?;
        let host = &*host;
        let out = slot_output(pages, &host.meta, host.frames.as_slice(), limit)?;
        install(&out);
        Ok(())
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        vec![("nvcomp_failed_pages", self.failed_pages.load(Relaxed))]
    }

    fn memory(&self) -> BackendMemory {
        let pages = self.pages as u64;
        let stride = self.stride as u64;
        let page = PAGE_SIZE as u64;
        BackendMemory {
            pinned_host_bytes: pages * (page + stride + 16),
            host_bytes: meta_bytes(self.pages) as u64,
            device_bytes: pages * (page + stride + 40) + self.device.temp.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use uzram_core::batch::{PageResult, SlotOutput};

    use super::*;

    fn bytes<const N: usize>(words: &[u64]) -> Vec<u8> {
        words
            .iter()
            .flat_map(|w| w.to_le_bytes()[..N].to_vec())
            .collect()
    }

    #[test]
    fn what_nvcomp_returns_becomes_the_slot_format_and_its_failures_are_left_as_they_were() {
        // A frame; one at the raw limit; a failed status; one past nvCOMP's own bound.
        let sizes = bytes::<8>(&[100, 3000, 50, 5000]);
        let statuses = bytes::<4>(&[0, 0, 19, 0]);
        let crcs = bytes::<4>(&[0xa, 0xb, 0xc, 0xd]);
        let back = Returned {
            sizes: &sizes,
            statuses: &statuses,
            crcs: &crcs,
        };
        let (stride, max, limit) = (4112, 4107, 3000);
        let mut meta = vec![0u8; meta_bytes(4)];
        let failed = back.encode(4, stride, max, limit, &mut meta);
        assert_eq!(
            failed,
            Some(Failed {
                pages: 2,
                first: 2,
                status: 19,
                size: 50
            })
        );
        let packed = vec![7u8; 4 * stride];
        let out = SlotOutput::new(4, &meta, &packed, limit).unwrap();
        assert_eq!(out.page(0), Ok(PageResult::Compressed(&packed[..100])));
        assert_eq!(out.page(1), Ok(PageResult::Raw));
        assert_eq!(out.page(2), Ok(PageResult::Rejected));
        assert_eq!(out.page(3), Ok(PageResult::Rejected));
        assert_eq!(out.checksum(3), Ok(0xd));
        // Every page good: nothing failed.
        let ok = bytes::<4>(&[0, 0, 0, 0]);
        let sizes = bytes::<8>(&[100, 200, 300, 400]);
        let back = Returned {
            sizes: &sizes,
            statuses: &ok,
            crcs: &crcs,
        };
        assert_eq!(back.encode(4, stride, max, limit, &mut meta), None);
        let out = SlotOutput::new(4, &meta, &packed, limit).unwrap();
        assert_eq!(
            out.page(3),
            Ok(PageResult::Compressed(
                &packed[3 * stride..3 * stride + 400]
            ))
        );
    }
}
