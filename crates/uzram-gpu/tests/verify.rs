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
    // Three kinds of damage, each on its own pages: the first byte of a block (the token's
    // literal count changes, so the block decodes to something else or nothing); a literal
    // byte in the block's second half (the sequences still parse as the compressor's hints
    // say: the parallel check itself must see the byte differ); and a good block whose
    // second sequence hint is wrong (it must still pass, by the serial walk).
    let meta = dev_meta.as_slice().to_vec();
    let mut corrupted = Vec::new();
    let (mut tokens, mut literals, mut misled) = (0, 0, Vec::new());
    let mut poke = HostBuf::new(&gpu, 2).unwrap();
    let read = |ptr: u64, len: usize| {
        let mut bytes = vec![0u8; len];
        // SAFETY: a synchronous copy into a local from device memory inside the buffers.
        unsafe { stream.copy_to_host(&mut bytes, ptr).unwrap() };
        stream.synchronize().unwrap();
        bytes
    };
    let mut write = |ptr: u64, bytes: &[u8]| {
        poke.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: pinned bytes into device memory inside the buffers, synchronized at once.
        unsafe {
            stream
                .copy_to_device(ptr, poke.as_slice().as_ptr(), bytes.len())
                .unwrap()
        };
        stream.synchronize().unwrap();
    };
    for i in 0..n {
        let size = word(&meta, i) as usize;
        if size == 0 || size >= THRESHOLD {
            continue;
        }
        let off = u64::from(word(&meta, n + i));
        let hints_top = bufs.scratch + ((i + 1) * PAGE_SIZE) as u64;
        match i % 6 {
            0 => {
                let token = read(bufs.packed + off, 1)[0];
                write(bufs.packed + off, &[token ^ 0x10]);
                corrupted.push(i);
                tokens += 1;
            }
            2 => {
                let block = read(bufs.packed + off, size);
                if let Some(at) = literal_bytes(&block).into_iter().find(|&at| at >= size / 2) {
                    write(bufs.packed + off + at as u64, &[block[at] ^ 0x01]);
                    corrupted.push(i);
                    literals += 1;
                }
            }
            4 => {
                let count = u16::from_le_bytes(read(hints_top - 2, 2).try_into().unwrap());
                if (2..0xffff).contains(&count) {
                    let second = hints_top - 6;
                    let hint = u16::from_le_bytes(read(second, 2).try_into().unwrap());
                    write(second, &(hint + 1).to_le_bytes());
                    misled.push(i);
                }
            }
            _ => {}
        }
    }
    eprintln!(
        "{tokens} tokens and {literals} literal bytes corrupted, {} hints misled",
        misled.len()
    );
    assert!(literals > 10 && misled.len() > 10, "too few pages damaged");
    assert!(corrupted.len() > 10, "{} corrupted", corrupted.len());
    // SAFETY: as above; the compression kernel's results are in place.
    unsafe { launch::verify(&gpu, &stream, bufs, n as u32).unwrap() };
    stream.synchronize().unwrap();
    let walked = word(&read(bufs.ctrl, CTRL_WORDS * 4), 3) as usize;
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
    eprintln!(
        "{rejected} corrupted blocks rejected, {passed} good blocks passed, \
         {walked} walked serially"
    );
    assert_eq!(rejected, corrupted.len());
    assert!(passed > 100);
    // Every damaged block and every misled one fails the hinted check; the other blocks
    // (all but those whose hints did not fit their slot) pass it.
    let damaged = corrupted.len() + misled.len();
    assert!(
        walked >= damaged,
        "{walked} serial walks for {damaged} damaged blocks"
    );
    assert!(
        walked <= damaged + passed / 20,
        "{walked} serial walks: the hints went unused ({damaged} damaged, {passed} passed)"
    );
}

/// Offsets of the literal bytes of an LZ4 block.
fn literal_bytes(block: &[u8]) -> Vec<usize> {
    let mut at = Vec::new();
    let mut ip = 0;
    let length = |ip: &mut usize, mut n: usize| {
        if n == 15 {
            while let Some(&b) = block.get(*ip) {
                *ip += 1;
                n += b as usize;
                if b != 255 {
                    break;
                }
            }
        }
        n
    };
    while ip < block.len() {
        let token = block[ip];
        ip += 1;
        let lit = length(&mut ip, usize::from(token >> 4));
        at.extend(ip..(ip + lit).min(block.len()));
        ip += lit + 2;
        if ip > block.len() {
            break;
        }
        length(&mut ip, usize::from(token & 15));
    }
    at
}
