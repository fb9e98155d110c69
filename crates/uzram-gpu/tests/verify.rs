//! The device's decode-and-compare check rejects blocks corrupted between compression and
//! export, and passes the others through unchanged. Drives the kernels directly so a
//! block can be corrupted on the device in between. Skips where there is no GPU.

mod common;

use uzram_core::batch::{meta_bytes, PageResult, SlotOutput};
use uzram_core::PAGE_SIZE;
use uzram_gpu::driver::{DevBuf, HostBuf, Kernel, Stream};
use uzram_gpu::launch::{self, SlotBuffers, CTRL_WORDS};
use uzram_gpu::{ErrorKind, Gpu};

const THRESHOLD: usize = 3625;

fn word(meta: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(meta[i * 4..i * 4 + 4].try_into().unwrap())
}

#[test]
fn corrupted_blocks_are_rejected_and_others_pass() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("skipping: no CUDA driver or GPU: {e}");
            return;
        }
        Err(e) => panic!("GPU present but failed to open: {e}"),
    };
    let pages = common::load_pages(&common::slice_paths()[0]);
    let n = pages.len() / PAGE_SIZE;
    let bytes = pages.len();
    let stream = Stream::new(&gpu).unwrap();
    let dev: Vec<DevBuf> = [bytes, bytes, bytes, meta_bytes(n), CTRL_WORDS * 4]
        .iter()
        .map(|&b| DevBuf::new(&gpu, b).unwrap())
        .collect();
    let out_meta = HostBuf::mapped(&gpu, meta_bytes(n)).unwrap();
    let out_packed = HostBuf::mapped(&gpu, bytes).unwrap();
    let mut host_in = HostBuf::new(&gpu, bytes).unwrap();
    host_in.as_mut_slice().copy_from_slice(&pages);
    let mut ctrl = HostBuf::new(&gpu, CTRL_WORDS * 4).unwrap();
    for (d, w) in ctrl
        .as_mut_slice()
        .chunks_exact_mut(4)
        .zip([n as u32, THRESHOLD as u32, 0, 0])
    {
        d.copy_from_slice(&w.to_le_bytes());
    }
    let bufs = SlotBuffers {
        input: dev[0].ptr(),
        scratch: dev[1].ptr(),
        packed: dev[2].ptr(),
        meta: dev[3].ptr(),
        ctrl: dev[4].ptr(),
        out_packed: out_packed.device_ptr().unwrap(),
        out_meta: out_meta.device_ptr().unwrap(),
    };
    let mut dev_meta = HostBuf::new(&gpu, meta_bytes(n)).unwrap();
    // SAFETY: every buffer above is sized for `n` pages and outlives the synchronizations
    // below; the host buffers are pinned.
    unsafe {
        stream
            .copy_to_device(bufs.ctrl, ctrl.as_slice().as_ptr(), CTRL_WORDS * 4)
            .unwrap();
        stream
            .copy_to_device(bufs.input, host_in.as_slice().as_ptr(), bytes)
            .unwrap();
        launch::compress(&gpu, &stream, Kernel::Fast, bufs, n as u32).unwrap();
        stream
            .copy_to_host(dev_meta.as_mut_slice(), bufs.meta)
            .unwrap();
    }
    stream.synchronize().unwrap();
    // Corrupt the first byte of every 5th compressed block on the device: the token's
    // literal count changes, so the block decodes to something else or nothing.
    let meta = dev_meta.as_slice().to_vec();
    let mut corrupted = Vec::new();
    let mut poke = HostBuf::new(&gpu, 1).unwrap();
    for i in 0..n {
        let size = word(&meta, i);
        if size == 0 || size >= THRESHOLD as u32 || corrupted.len() * 5 > i {
            continue;
        }
        let off = word(&meta, n + i) as u64;
        // A token byte with a different literal count.
        let mut token = [0u8; 1];
        // SAFETY: `token` is a local the synchronous copy fills from a device byte of
        // the packed buffer, inside its `bytes` bytes.
        unsafe {
            stream.copy_to_host(&mut token, bufs.packed + off).unwrap();
        }
        stream.synchronize().unwrap();
        poke.as_mut_slice()[0] = token[0] ^ 0x10;
        // SAFETY: one pinned byte into the packed buffer at a block's start.
        unsafe {
            stream
                .copy_to_device(bufs.packed + off, poke.as_slice().as_ptr(), 1)
                .unwrap();
        }
        stream.synchronize().unwrap();
        corrupted.push(i);
    }
    assert!(corrupted.len() > 10, "{} corrupted", corrupted.len());
    // SAFETY: as above; the compression kernel's results are in place.
    unsafe { launch::verify(&gpu, &stream, bufs, n as u32).unwrap() };
    stream.synchronize().unwrap();
    let out = SlotOutput::new(n, out_meta.as_slice(), out_packed.as_slice(), THRESHOLD).unwrap();
    let mut codec = uzram_core::codec::Lz4Codec::new();
    let mut back = [0u8; PAGE_SIZE];
    let (mut rejected, mut passed) = (0, 0);
    for i in 0..n {
        let page = &pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
        match out.page(i).unwrap() {
            PageResult::Rejected => {
                assert!(
                    corrupted.contains(&i),
                    "page {i} rejected but not corrupted"
                );
                rejected += 1;
            }
            PageResult::Compressed(b) => {
                assert!(!corrupted.contains(&i), "corrupted page {i} passed");
                use uzram_core::codec::PageCodec;
                codec.decompress(b, &mut back).unwrap();
                assert_eq!(&back[..], page, "page {i}");
                passed += 1;
            }
            PageResult::SameFilled(w) => {
                assert_eq!(
                    uzram_core::page::same_filled_word(page.try_into().unwrap()),
                    Some(w)
                )
            }
            PageResult::Raw => {}
        }
    }
    eprintln!("{rejected} corrupted blocks rejected, {passed} good blocks passed");
    assert_eq!(rejected, corrupted.len());
    assert!(passed > 100);
}
