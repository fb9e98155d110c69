//! The device's decode-and-compare check rejects blocks corrupted between compression and
//! export, and passes the others through unchanged, whatever the compressor's sequence hints
//! say. Drives the kernels directly so a block or its hints can be damaged on the device in
//! between. Skips where there is no GPU.

mod common;

use uzram_core::batch::{meta_bytes, PageResult, SlotOutput};
use uzram_core::PAGE_SIZE;
use uzram_gpu::driver::{DevBuf, HostBuf, Kernel, Stream};
use uzram_gpu::launch::{
    self, scratch_bytes, SlotBuffers, CTRL_SERIAL_WALKS, CTRL_WORDS, SCRATCH_SLOT_BYTES,
};
use uzram_gpu::{ErrorKind, Gpu};

const THRESHOLD: usize = 3625;
/// The most hints a page's hint area holds (the kernel's MAX_HINTS); any larger count
/// means "no hints".
const MAX_HINTS: u16 = (PAGE_SIZE / 2 - 1) as u16;

fn word(meta: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(meta[i * 4..i * 4 + 4].try_into().unwrap())
}

#[test]
fn fast_blocks_corrupted_are_rejected_and_others_pass() {
    damage_and_check(Kernel::Fast);
}

#[test]
fn high_blocks_corrupted_are_rejected_and_others_pass() {
    damage_and_check(Kernel::High);
}

/// Copies between the host and the test's device buffers, each range checked to lie inside
/// one of them (what the copies' safety rests on), synchronized before returning.
struct Poke<'a> {
    stream: &'a Stream,
    ranges: Vec<(u64, usize)>,
    pinned: HostBuf,
}

impl Poke<'_> {
    fn check(&self, ptr: u64, len: usize) {
        assert!(
            self.ranges
                .iter()
                .any(|&(base, size)| ptr >= base && ptr + len as u64 <= base + size as u64),
            "{len} bytes at {ptr:#x} lie outside the test's device buffers"
        );
    }

    fn read(&self, ptr: u64, len: usize) -> Vec<u8> {
        self.check(ptr, len);
        let mut bytes = vec![0u8; len];
        // SAFETY: `check` put the `len` bytes at `ptr` inside a live device buffer; the copy
        // into a local is synchronized before the local is read.
        unsafe { self.stream.copy_to_host(&mut bytes, ptr).unwrap() };
        self.stream.synchronize().unwrap();
        bytes
    }

    fn write(&mut self, ptr: u64, bytes: &[u8]) {
        self.check(ptr, bytes.len());
        self.pinned.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: `check` put the destination inside a live device buffer; the source is
        // pinned and stays untouched until the synchronization below.
        unsafe {
            self.stream
                .copy_to_device(ptr, self.pinned.as_slice().as_ptr(), bytes.len())
                .unwrap()
        };
        self.stream.synchronize().unwrap();
    }
}

fn damage_and_check(kernel: Kernel) {
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
    // As the slots run it: the high parse's first packed bytes come by a copy, the rest (and
    // the fast parse's all) by the check's stores.
    let copied = launch::copied_bytes(kernel, n);
    let stream = Stream::new(&gpu).unwrap();
    let dev: Vec<DevBuf> = launch::device_buffer_bytes(n)
        .iter()
        .map(|&b| DevBuf::new(&gpu, b).unwrap())
        .collect();
    let out_meta = HostBuf::mapped(&gpu, meta_bytes(n)).unwrap();
    let out_packed = HostBuf::mapped(&gpu, bytes).unwrap();
    let mut host_in = HostBuf::new(&gpu, bytes).unwrap();
    host_in.as_mut_slice().copy_from_slice(&pages);
    let mut ctrl = HostBuf::new(&gpu, CTRL_WORDS * 4).unwrap();
    ctrl.as_mut_slice()
        .copy_from_slice(&launch::control_words(n, THRESHOLD, copied));
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
        launch::compress(&gpu, &stream, kernel, bufs, n as u32).unwrap();
        stream
            .copy_to_host(dev_meta.as_mut_slice(), bufs.meta)
            .unwrap();
    }
    stream.synchronize().unwrap();
    // Kinds of damage, each on its own pages. Blocks: the first byte (the token's literal
    // count changes, so the block decodes to something else or nothing); a literal byte in
    // the second half (the sequences still parse as the hints say: the parallel check itself
    // must see the byte differ). Hints of good blocks, which must still pass (by the serial
    // walk): the second hint moved by one; the count cut to 1; the count raised to the most
    // the slot holds (the rest of the slot read as hints); a count no slot holds.
    let meta = dev_meta.as_slice().to_vec();
    let mut corrupted = Vec::new();
    let (mut tokens, mut literals, mut misled) = (0, 0, Vec::new());
    let mut unhinted = Vec::new();
    let mut poke = Poke {
        stream: &stream,
        ranges: vec![
            (bufs.scratch, scratch_bytes(n)),
            (bufs.packed, bytes),
            (bufs.meta, launch::device_buffer_bytes(n)[3]),
        ],
        pinned: HostBuf::new(&gpu, 4).unwrap(),
    };
    // Blocks placed (by their offset) past the end of what a slot's blocks can fill, as a
    // faulty compressor could place them: rejected before anything is read or exported
    // there (the result buffer is host memory). Not walked: no check of the bytes runs.
    let mut misplaced = Vec::new();
    for i in 0..n {
        let size = word(&meta, i) as usize;
        if size == 0 || size >= THRESHOLD {
            continue;
        }
        let off = u64::from(word(&meta, n + i));
        let count_at = bufs.scratch + ((i + 1) * SCRATCH_SLOT_BYTES) as u64 - 2;
        let count = u16::from_le_bytes(poke.read(count_at, 2).try_into().unwrap());
        let hinted = (2..=MAX_HINTS).contains(&count);
        if !hinted {
            unhinted.push((i, count));
        }
        match i % 12 {
            9 => {
                let past = (bytes - size / 2) as u32;
                poke.write(bufs.meta + ((n + i) * 4) as u64, &past.to_le_bytes());
                misplaced.push(i);
            }
            0 => {
                let token = poke.read(bufs.packed + off, 1)[0];
                poke.write(bufs.packed + off, &[token ^ 0x10]);
                corrupted.push(i);
                tokens += 1;
            }
            2 | 8 => {
                let block = poke.read(bufs.packed + off, size);
                if let Some(at) = literal_bytes(&block).into_iter().find(|&at| at >= size / 2) {
                    poke.write(bufs.packed + off + at as u64, &[block[at] ^ 0x01]);
                    corrupted.push(i);
                    literals += 1;
                }
            }
            4 if hinted => {
                let second = count_at - 4;
                let hint = u16::from_le_bytes(poke.read(second, 2).try_into().unwrap());
                poke.write(second, &(hint + 1).to_le_bytes());
                misled.push(i);
            }
            6 if hinted => {
                poke.write(count_at, &1u16.to_le_bytes());
                misled.push(i);
            }
            10 if hinted => {
                poke.write(count_at, &MAX_HINTS.to_le_bytes());
                misled.push(i);
            }
            11 if hinted => {
                poke.write(count_at, &(MAX_HINTS + 1).to_le_bytes());
                misled.push(i);
            }
            _ => {}
        }
    }
    // The same for a same-filled page's word.
    if let Some(i) = (0..n).find(|&i| word(&meta, i) == u32::MAX) {
        let past = (bytes - 4) as u32;
        poke.write(bufs.meta + ((n + i) * 4) as u64, &past.to_le_bytes());
        misplaced.push(i);
    }
    let compressed: usize = (0..n)
        .map(|i| word(&meta, i) as usize)
        .filter(|&size| size < THRESHOLD)
        .sum();
    eprintln!(
        "{kernel:?}: {compressed} bytes in blocks; {tokens} tokens and {literals} literal bytes \
         corrupted, {} hints misled",
        misled.len()
    );
    // The hints have an area of their own, so every block carries them, however long.
    assert!(
        unhinted.is_empty(),
        "blocks without hints (page, count): {unhinted:?}"
    );
    assert!(literals > 10 && misled.len() > 10, "too few pages damaged");
    assert!(corrupted.len() > 10, "{} corrupted", corrupted.len());
    // SAFETY: as above; the compression kernel's results are in place; `out_packed` is read
    // only after the synchronization.
    unsafe {
        launch::verify(&gpu, &stream, bufs, n as u32).unwrap();
        launch::copy_packed(&stream, &out_packed, bufs.packed, copied).unwrap();
    }
    stream.synchronize().unwrap();
    poke.ranges.push((bufs.ctrl, CTRL_WORDS * 4));
    let walked = word(&poke.read(bufs.ctrl, CTRL_WORDS * 4), CTRL_SERIAL_WALKS) as usize;
    let out = SlotOutput::new(n, out_meta.as_slice(), out_packed.as_slice(), THRESHOLD).unwrap();
    let mut codec = uzram_core::codec::Lz4Codec::new();
    let mut back = [0u8; PAGE_SIZE];
    let (mut rejected, mut passed) = (0, 0);
    for i in 0..n {
        let page = &pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
        // The device's CRC32C of every page (raw, same-filled, rejected: all of them) is
        // the CPU's.
        assert_eq!(
            out.checksum(i),
            Ok(uzram_core::page::page_checksum(page.try_into().unwrap())),
            "page {i}'s checksum"
        );
        match out.page(i).unwrap() {
            PageResult::Rejected if misplaced.contains(&i) => {}
            PageResult::Rejected => {
                assert!(
                    corrupted.contains(&i),
                    "page {i} rejected but not corrupted"
                );
                rejected += 1;
            }
            _ if misplaced.contains(&i) => panic!("page {i}, placed past the blocks' end, passed"),
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
        "{kernel:?}: {rejected} corrupted blocks rejected, {passed} good blocks passed, \
         {walked} walked serially"
    );
    assert_eq!(rejected, corrupted.len());
    assert!(misplaced.len() > 5, "{} misplaced", misplaced.len());
    assert!(passed > 100);
    // Every damaged block and every misled one fails the hinted check and is walked
    // serially; every other block passes the hinted check.
    let damaged = corrupted.len() + misled.len();
    assert_eq!(
        walked, damaged,
        "serial walks against damaged or misled blocks ({passed} passed)"
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
