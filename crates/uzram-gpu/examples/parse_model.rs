//! A CPU model of the `high` kernel's parse, to tell what separates it from LZ4HC-9 on a
//! corpus: its search (how many chain candidates a position gets) or its parse. No GPU
//! needed.
//!
//! The model searches every position (the kernel samples every 16th first and lets the rest
//! inherit: `--sample 16`) over exact 4-byte chains (the kernel's 11-bit hash also chains
//! other bytes, which its one-byte test skips), keeping each position's longest match among
//! its `DEPTH` nearest candidates, nearest on ties; then it parses those matches in every way
//! of [`PARSES`], among them:
//! - `lazy`: the kernel's greedy rule before run 192 (take the next position's match while it
//!   is longer by 2 or more, at most 2 steps; extend each match back into its literals);
//! - `kernel_price`: the kernel's price pass since run 192 (whole matches, lengths weighed up
//!   to 64, 32 parts of 132 positions, each decided from 64 positions past it);
//! - `price`: a backward shortest path over the same matches (each position a literal, or its
//!   match cut to any length from 4): the least any parse of those matches stores.
//!
//! Ratios follow zram's rules (same-filled pages left out, a page that does not shrink below
//! `--threshold` stored raw), beside liblz4's default, HC-9 and HC-12 on the same pages.
//!
//! `--search-cap 64` compares candidates as the kernel does (by their first 64 bytes, the
//! walk ending at the first with 64; the whole length of the one chosen is kept).
//!
//! `--long-depth 8`: each search first walks up to 8 candidates of a second chain, of
//! positions with the same first 8 bytes.
//!
//! `--pattern 1`: as LZ4HC at level 9 and up (its pattern analysis), a search from a
//! position whose first 4 bytes are one byte repeated takes each earlier run of that byte as
//! one candidate, the one of the run that matches furthest (where the run has as many of the
//! byte left as the position, so that what follows both may match too, else the run's
//! start), and walks on from before the run. The kernel does so by default (`HIGH_PATTERN`);
//! the model only when asked.
//!
//! `--sample 16`: as the kernel's two passes (HIGH_SAMPLE), a position between two multiples
//! of 16 takes over the match of the multiple before it, same offset, where that match still
//! covers MIN_MATCH bytes of it (`--inherit N`: N bytes), and searches its own chain only
//! otherwise.
//!
//! `--two-phase 8`: the search in two phases (run 278's kernel, `HIGH_TWO_PHASE` in
//! e34bf46's `lz4.cu`): every position first walks at most 8 candidates; then only the
//! positions a parse can start a literal or a sequence at walk on to `--depth` (`--path`:
//! `lanes`, the kernel's per-thread walks of the greedy-and-lazy parse over the first
//! phase's matches; `walk`, that walk from the page's
//! start; `reach`, every position no earlier match covers; `price`, the price pass's
//! decisions), each with the `--near` (default 2) positions after it. As in the kernel, every
//! marked position walks in the second phase (also one that took over its sample's match in
//! the first), from its chain's head again (its steps count in full), and the longer of the
//! two phases' matches stays.
//!
//! Usage: parse_model [--depth N,N,...] [--long-depth N,N,...] [--pattern N,N] [--sample N,N]
//! [--inherit N] [--threshold N] [--pages N] [--search-cap N] [--two-phase N [--near N]
//! [--path lanes|walk|reach|price]] CORPUS.pages.zst...

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;

use uzram_core::page::same_filled_word;
use uzram_core::PAGE_SIZE;

const MIN_MATCH: usize = 4;
/// The last position a match may start at (LZ4's MFLIMIT).
const LAST_START: usize = PAGE_SIZE - 12;
/// Where a match must end by (LZ4's LASTLITERALS).
const MATCH_END: usize = PAGE_SIZE - 5;
const NO_POS: u32 = u32::MAX;

struct Args {
    depths: Vec<usize>,
    threshold: usize,
    pages: usize,
    search_cap: usize,
    long_depths: Vec<usize>,
    patterns: Vec<bool>,
    samples: Vec<usize>,
    inherit: usize,
    two_phase: Option<usize>,
    near: usize,
    path: DeepPath,
    corpora: Vec<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        depths: vec![32, 64, 256],
        threshold: 3625,
        pages: usize::MAX,
        search_cap: usize::MAX,
        long_depths: vec![0],
        patterns: vec![false],
        samples: vec![1],
        inherit: MIN_MATCH,
        two_phase: None,
        near: 2,
        path: DeepPath::Lanes,
        corpora: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--depth" => {
                a.depths = value("--depth")?
                    .split(',')
                    .map(|d| d.parse().map_err(|_| format!("bad depth {d}")))
                    .collect::<Result<_, _>>()?;
            }
            "--threshold" => {
                a.threshold = value("--threshold")?
                    .parse()
                    .map_err(|_| "bad --threshold")?
            }
            "--long-depth" => {
                a.long_depths = value("--long-depth")?
                    .split(',')
                    .map(|d| d.parse().map_err(|_| format!("bad long depth {d}")))
                    .collect::<Result<_, _>>()?;
            }
            "--pattern" => {
                a.patterns = value("--pattern")?
                    .split(',')
                    .map(|n| match n {
                        "0" => Ok(false),
                        "1" => Ok(true),
                        _ => Err(format!("bad --pattern value {n} (0 or 1)")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--sample" => {
                a.samples = value("--sample")?
                    .split(',')
                    .map(|n| match n.parse::<usize>() {
                        Ok(n) if n >= 1 => Ok(n),
                        _ => Err(format!("bad --sample value {n} (1 or more)")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--inherit" => {
                a.inherit = match value("--inherit")?.parse::<usize>() {
                    Ok(n) if n >= MIN_MATCH => n,
                    _ => return Err(format!("bad --inherit (at least {MIN_MATCH})")),
                };
            }
            "--search-cap" => {
                a.search_cap = value("--search-cap")?
                    .parse()
                    .map_err(|_| "bad --search-cap")?
            }
            "--pages" => a.pages = value("--pages")?.parse().map_err(|_| "bad --pages")?,
            "--two-phase" => {
                a.two_phase = Some(
                    value("--two-phase")?
                        .parse()
                        .map_err(|_| "bad --two-phase")?,
                )
            }
            "--near" => a.near = value("--near")?.parse().map_err(|_| "bad --near")?,
            "--path" => {
                let v = value("--path")?;
                a.path = DeepPath::parse(&v)
                    .ok_or(format!("bad --path {v} (walk, lanes, reach or price)"))?;
            }
            s if s.starts_with("--") => return Err(format!("unknown option {s}")),
            _ => a.corpora.push(arg.into()),
        }
    }
    if a.search_cap < MIN_MATCH {
        return Err(format!(
            "--search-cap must be at least {MIN_MATCH}, the shortest match"
        ));
    }
    if a.corpora.is_empty() || a.depths.contains(&0) {
        return Err(
            "usage: parse_model [--depth N,N,...] [--long-depth N,N,...] [--pattern N,N] [--sample N,N] [--inherit N] [--threshold N] [--pages N] [--search-cap N] [--two-phase N [--near N] [--path lanes|walk|reach|price]] CORPUS...".into(),
        );
    }
    Ok(a)
}

fn read32(page: &[u8], p: usize) -> u32 {
    u32::from_le_bytes([page[p], page[p + 1], page[p + 2], page[p + 3]])
}

/// How many bytes from `p` on (up to MATCH_END) equal those from `cand`, 8 at a time.
fn match_len(page: &[u8], cand: usize, p: usize) -> usize {
    let mut l = 0;
    while p + l + 8 <= MATCH_END {
        let a = u64::from_le_bytes(page[cand + l..cand + l + 8].try_into().expect("8 bytes"));
        let b = u64::from_le_bytes(page[p + l..p + l + 8].try_into().expect("8 bytes"));
        if a != b {
            return l + ((a ^ b).trailing_zeros() / 8) as usize;
        }
        l += 8;
    }
    while p + l < MATCH_END && page[cand + l] == page[p + l] {
        l += 1;
    }
    l
}

/// How a page is searched.
#[derive(Clone, Copy)]
struct Search {
    /// Candidates of the 4-byte chain.
    depth: usize,
    /// Before them, up to this many candidates of a chain of positions with the same first 8
    /// bytes (a second hash, as zstd's long matches), which reaches past `depth` 4-byte
    /// candidates that share only their first 4 to 7 bytes.
    long: usize,
    /// Candidates compared by their first `cap` bytes only, the walk ending at the first
    /// that has that many (the kernel's HIGH_CAP and HIGH_NICE); the length kept is the
    /// chosen candidate's whole length.
    cap: usize,
    /// Runs of one byte as LZ4HC's pattern analysis takes them (`--pattern`).
    pattern: bool,
    /// `--sample` and `--inherit`.
    sample: usize,
    inherit: usize,
}

/// Each position's longest match among its `depth` nearest earlier positions with the same
/// first 4 bytes (length 0: none of at least MIN_MATCH), with its offset.
struct Matches {
    len: Vec<usize>,
    off: Vec<usize>,
    head: Vec<u32>,
    prev: Vec<u32>,
    /// The chains of 8-byte prefixes (`--long-depth`).
    head8: Vec<u32>,
    prev8: Vec<u32>,
    /// Candidates compared, over every search since the counts were last taken.
    steps: u64,
    /// Of those, the ones whose byte at the best length so far was the position's: the
    /// kernel measures only those (its one-byte test).
    measured: u64,
    /// Candidates compared by each position's own search.
    pos_steps: Vec<u32>,
}

impl Matches {
    fn new() -> Self {
        Self {
            len: vec![0; PAGE_SIZE],
            off: vec![0; PAGE_SIZE],
            head: vec![NO_POS; 1 << 16],
            prev: vec![NO_POS; PAGE_SIZE],
            head8: vec![NO_POS; 1 << 16],
            prev8: vec![NO_POS; PAGE_SIZE],
            steps: 0,
            measured: 0,
            pos_steps: vec![0; PAGE_SIZE],
        }
    }

    /// Each position's best match as `how` searches.
    fn search(&mut self, page: &[u8], how: &Search) {
        let Search {
            depth,
            long,
            cap,
            pattern,
            sample,
            inherit,
        } = *how;
        self.head.fill(NO_POS);
        self.head8.fill(NO_POS);
        self.len.fill(0);
        self.pos_steps.fill(0);
        for p in 0..=LAST_START {
            let v = read32(page, p);
            let v8 = u64::from_le_bytes(page[p..p + 8].try_into().expect("8 bytes"));
            let h = (v.wrapping_mul(2_654_435_761) >> 16) as usize;
            let h8 = (v8.wrapping_mul(0x9E37_79B1_85EB_CA87) >> 48) as usize;
            let sampled = p - p % sample;
            if sampled != p && self.len[sampled] >= p - sampled + inherit {
                // Inside the sample's match: taken over, no search.
                self.len[p] = self.len[sampled] - (p - sampled);
                self.off[p] = self.off[sampled];
                self.prev[p] = self.head[h];
                self.head[h] = p as u32;
                self.prev8[p] = self.head8[h8];
                self.head8[h8] = p as u32;
                continue;
            }
            let (mut best, mut off, mut whole) = (MIN_MATCH - 1, 0, 0);
            let mut measured = 0;
            let mut consider =
                |cand: usize, best: &mut usize, off: &mut usize, whole: &mut usize| {
                    // The kernel measures a candidate only when its byte `best` is p's.
                    let at = (*best).min(cap - 1);
                    if page[cand + at] == page[p + at] {
                        measured += 1;
                    }
                    let l = match_len(page, cand, p);
                    if l.min(cap) > *best {
                        (*best, *whole) = (l.min(cap), l);
                        *off = p - cand;
                    }
                };
            let (mut c, mut seen) = (self.head8[h8], 0);
            while c != NO_POS && seen < long && best < cap {
                let cand = c as usize;
                if page[cand..cand + 8] == page[p..p + 8] {
                    consider(cand, &mut best, &mut off, &mut whole);
                    seen += 1;
                }
                c = self.prev8[cand];
            }
            self.steps += seen as u64;
            // p's run of one byte, when its first 4 bytes are one: how many of it from p.
            let byte = page[p];
            let run = if pattern && v == u32::from(byte) * 0x0101_0101 {
                run_forward(page, p, byte)
            } else {
                0
            };
            let (mut c, mut seen) = (self.head[h], 0);
            while c != NO_POS && seen < depth && best < cap {
                let cand = c as usize;
                if read32(page, cand) == v {
                    if run > 0 && cand > 0 && self.prev[cand] == c - 1 {
                        // Inside an earlier run of the byte (the chain goes on in it): its
                        // best candidate, then on from before the run.
                        let start = run_backward(page, cand, byte);
                        let end = cand + run_forward(page, cand, byte);
                        let best_in_run = if end > p {
                            cand // p's own run: every candidate in it matches `run` bytes
                        } else if end - start < run {
                            start
                        } else {
                            end - run
                        };
                        consider(best_in_run, &mut best, &mut off, &mut whole);
                        seen += 1;
                        c = self.prev[start];
                        continue;
                    }
                    consider(cand, &mut best, &mut off, &mut whole);
                    seen += 1;
                }
                c = self.prev[cand];
            }
            self.steps += seen as u64;
            self.pos_steps[p] = seen as u32;
            self.measured += measured;
            self.prev[p] = self.head[h];
            self.head[h] = p as u32;
            self.prev8[p] = self.head8[h8];
            self.head8[h8] = p as u32;
            if best >= MIN_MATCH {
                self.len[p] = whole;
                self.off[p] = off;
            }
        }
    }
}

/// Which positions the two-phase search (`--two-phase A`) walks on to the full depth, after
/// every position walked at most A candidates.
#[derive(Clone, Copy)]
enum DeepPath {
    /// The greedy-and-lazy parse of the first phase's matches, walked from the page's start:
    /// its literals, each decision and the `--near` positions after it.
    Walk,
    /// The same walk by the kernel's threads (`HIGH_TWO_PHASE` 3): each span of 16 positions
    /// walked alone, from 16 positions before it.
    Lanes,
    /// Every position no first-phase match reaches past, of those starting `--near` + 1 or
    /// more positions before it (a prefix maximum: no walk at all).
    Reach,
    /// The kernel's price pass over the first phase's matches, its decisions and the
    /// `--near` positions after each.
    Price,
}

impl DeepPath {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "walk" => Self::Walk,
            "lanes" => Self::Lanes,
            "reach" => Self::Reach,
            "price" => Self::Price,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Walk => "walk",
            Self::Lanes => "lanes",
            Self::Reach => "reach",
            Self::Price => "price",
        }
    }
}

/// Lengths as the kernel's first phase keeps them (capped at 64).
fn capped(m: &Matches, p: usize) -> usize {
    if p <= LAST_START {
        m.len[p].min(64)
    } else {
        0
    }
}

/// Marks, in `[start, end)`, the positions the greedy-and-lazy walk over `m` from `from`
/// visits (literals, decisions, the lazy steps' positions) and the `near` after each match.
fn walk_marks(m: &Matches, from: usize, start: usize, end: usize, near: usize, marks: &mut [bool]) {
    let mut mark = |q: usize| {
        if (start..end).contains(&q) {
            marks[q] = true;
        }
    };
    let mut a = from;
    while a < end {
        if capped(m, a) == 0 {
            mark(a);
            a += 1;
            continue;
        }
        let (mut mp, mut ml) = (a, capped(m, a));
        for _ in 0..2 {
            let l1 = capped(m, mp + 1);
            if l1 <= ml + 1 {
                break;
            }
            mark(mp);
            mp += 1;
            ml = l1;
        }
        (mp..=mp + near).for_each(&mut mark);
        a = mp + ml;
    }
}

/// The positions the second phase searches (`marks`), as `path` picks them.
fn deep_marks(m: &Matches, path: DeepPath, near: usize, scratch: &mut Scratch, marks: &mut [bool]) {
    marks.fill(false);
    let end = LAST_START + 1;
    match path {
        DeepPath::Walk => walk_marks(m, 0, 0, end, near, marks),
        DeepPath::Lanes => {
            for start in (0..end).step_by(16) {
                walk_marks(
                    m,
                    start.saturating_sub(16),
                    start,
                    (start + 16).min(end),
                    near,
                    marks,
                );
            }
        }
        DeepPath::Reach => {
            let mut reach = 0;
            for (q, mark) in marks.iter_mut().enumerate().take(end) {
                // `reach`: the furthest end of the matches starting before q - near.
                if q > near {
                    reach = reach.max(q - near - 1 + capped(m, q - near - 1));
                }
                *mark = reach <= q;
            }
        }
        DeepPath::Price => {
            segmented_bytes(m, 132, 64, 64, &mut scratch.cost, &mut scratch.choice);
            let mut p = 0;
            while p < end {
                (p..=(p + near).min(end - 1)).for_each(|q| marks[q] = true);
                p += scratch.choice[p].max(1);
            }
        }
    }
}

/// How many bytes from `p` on (before MATCH_END) are `byte`.
fn run_forward(page: &[u8], p: usize, byte: u8) -> usize {
    page[p..MATCH_END]
        .iter()
        .take_while(|&&b| b == byte)
        .count()
}

/// Where the run of `byte` that holds `p` starts.
fn run_backward(page: &[u8], p: usize, byte: u8) -> usize {
    p - page[..p].iter().rev().take_while(|&&b| b == byte).count()
}

/// Bytes an LZ4 length field of value `n` needs after its token nibble.
fn ext_bytes(n: usize) -> usize {
    if n >= 15 {
        (n - 15) / 255 + 1
    } else {
        0
    }
}

/// Bytes of a sequence of `lits` literals and a match of `ml` bytes.
fn seq_bytes(lits: usize, ml: usize) -> usize {
    1 + ext_bytes(lits) + lits + 2 + ext_bytes(ml - MIN_MATCH)
}

/// Bytes of the last sequence: `lits` literals alone.
fn last_bytes(lits: usize) -> usize {
    1 + ext_bytes(lits) + lits
}

/// The kernel's choice at `ip` (a position with a match): up to 2 lazy steps (the next
/// position's match while it is longer by 2 or more), then the match extended back into the
/// literals after `anchor`. Returns its start and length.
fn lazy_choice(page: &[u8], m: &Matches, ip: usize, anchor: usize) -> (usize, usize) {
    let (mut mp, mut ml) = (ip, m.len[ip]);
    for _ in 0..2 {
        let q = mp + 1;
        if q > LAST_START || m.len[q] <= ml + 1 {
            break;
        }
        mp = q;
        ml = m.len[q];
    }
    let off = m.off[mp];
    while mp > anchor && mp > off && page[mp - 1] == page[mp - 1 - off] {
        mp -= 1;
        ml += 1;
    }
    (mp, ml)
}

/// The kernel's parse: greedy, up to 2 lazy steps, each match extended back into its literals.
fn lazy_bytes(page: &[u8], m: &Matches) -> usize {
    let (mut ip, mut anchor, mut size) = (0, 0, 0);
    while ip <= LAST_START {
        if m.len[ip] == 0 {
            ip += 1;
            continue;
        }
        let (mp, ml) = lazy_choice(page, m, ip, anchor);
        size += seq_bytes(mp - anchor, ml);
        ip = mp + ml;
        anchor = ip;
    }
    size + last_bytes(PAGE_SIZE - anchor)
}

/// The kernel's parse with each match cut where two sequences reach furthest: a match of
/// `ml` at `mp` ends at the `k` (from MIN_MATCH to `ml`) whose position's own match reaches
/// furthest, the longest such `k` on ties (flexible parsing).
fn flex_bytes(page: &[u8], m: &Matches) -> usize {
    let (mut ip, mut anchor, mut size, mut was_cut) = (0, 0, 0, false);
    while ip <= LAST_START {
        if m.len[ip] == 0 {
            ip += 1;
            continue;
        }
        // After a cut, the match the cut was made for is taken as it is.
        let (mp, ml) = if was_cut {
            (ip, m.len[ip])
        } else {
            lazy_choice(page, m, ip, anchor)
        };
        let reach = |k: usize| {
            let q = mp + k;
            q + if q <= LAST_START { m.len[q] } else { 0 }
        };
        // Not cutting leaves one sequence where the match's end has none of its own: a cut
        // then costs a sequence (3 bytes) and must reach that much further to pay.
        let whole = reach(ml);
        let bar = if whole == mp + ml { whole + 3 } else { whole };
        let (mut cut, mut best) = (ml, bar);
        for k in (MIN_MATCH..ml).rev() {
            if reach(k) > best {
                cut = k;
                best = reach(k);
            }
        }
        size += seq_bytes(mp - anchor, cut);
        was_cut = cut < ml;
        ip = mp + cut;
        anchor = ip;
    }
    size + last_bytes(PAGE_SIZE - anchor)
}

/// The whole-match price parse as a GPU block runs it: the page in segments of `seg`
/// positions, each segment's backward pass on its own (a lane each), run on into the next
/// `overlap` positions with a flat cost after them, the lengths it weighs capped at `cap`
/// (the kernel keeps a length of 64 or more as 64, "measure it in full"); then one forward
/// walk that takes each chosen match at its full length.
fn segmented_bytes(
    m: &Matches,
    seg: usize,
    overlap: usize,
    cap: usize,
    local: &mut [usize],
    choice: &mut [usize],
) -> usize {
    let mut start = 0;
    while start < PAGE_SIZE {
        let end = (start + seg).min(PAGE_SIZE);
        let far = (end + overlap).min(PAGE_SIZE);
        // Each segment's costs are its own (`local`, from its start), so one segment's
        // overlap does not change the next segment's choices.
        local[..=far - start].fill(0);
        for p in (start..far).rev() {
            let i = p - start;
            let lit = local[i + 1] + 1;
            let longest = if p <= LAST_START {
                m.len[p].min(cap)
            } else {
                0
            };
            let mut best = lit;
            let mut take = 0;
            if longest >= MIN_MATCH {
                let j = (i + longest).min(far - start);
                let c = 3 + ext_bytes(longest - MIN_MATCH) + local[j];
                if c < best {
                    best = c;
                    // Taken at its full length: the kernel measures a capped one in full.
                    take = m.len[p];
                }
            }
            local[i] = best;
            if p < end {
                choice[p] = take;
            }
        }
        start = end;
    }
    choices_bytes(choice)
}

/// Bytes of the block that takes at each position reached the match of `choice[p]` bytes,
/// or a literal where it is 0.
fn choices_bytes(choice: &[usize]) -> usize {
    let (mut p, mut anchor, mut size) = (0, 0, 0);
    while p < PAGE_SIZE {
        if choice[p] == 0 {
            p += 1;
            continue;
        }
        size += seq_bytes(p - anchor, choice[p]);
        p += choice[p];
        anchor = p;
    }
    size + last_bytes(PAGE_SIZE - anchor)
}

/// The least bytes any parse of these matches stores: a backward shortest path where each
/// position is a literal (1 byte) or its match cut to any length from MIN_MATCH (token and
/// offset, 3 bytes, and the length's extra bytes); the parse found is then encoded exactly.
fn price_bytes(
    m: &Matches,
    cost: &mut [usize],
    choice: &mut [usize],
    allowed: &dyn Fn(usize, usize) -> bool,
) -> usize {
    cost[PAGE_SIZE] = 0;
    for p in (0..PAGE_SIZE).rev() {
        cost[p] = cost[p + 1] + 1;
        choice[p] = 0;
        let longest = if p <= LAST_START { m.len[p] } else { 0 };
        for l in (MIN_MATCH..=longest).filter(|&l| allowed(l, longest)) {
            let c = 3 + ext_bytes(l - MIN_MATCH) + cost[p + l];
            if c < cost[p] {
                cost[p] = c;
                choice[p] = l;
            }
        }
    }
    choices_bytes(choice)
}

/// Buffers a parse may use, made once.
struct Scratch {
    cost: Vec<usize>,
    choice: Vec<usize>,
}

type Parse = fn(&[u8], &Matches, &mut Scratch) -> usize;

/// Every parse the model weighs, by the name it reports.
const PARSES: [(&str, Parse); 13] = [
    ("lazy", |page, m, _| lazy_bytes(page, m)),
    ("flex", |page, m, _| flex_bytes(page, m)),
    ("price", |_, m, s| {
        price_bytes(m, &mut s.cost, &mut s.choice, &|_, _| true)
    }),
    ("price_whole", |_, m, s| {
        price_bytes(m, &mut s.cost, &mut s.choice, &|l, longest| l == longest)
    }),
    ("price_whole_4_8", |_, m, s| {
        price_bytes(m, &mut s.cost, &mut s.choice, &|l, longest| {
            l <= 8 || l == longest
        })
    }),
    ("price_whole_4_16", |_, m, s| {
        price_bytes(m, &mut s.cost, &mut s.choice, &|l, longest| {
            l <= 16 || l == longest
        })
    }),
    ("price_whole_last_5", |_, m, s| {
        price_bytes(m, &mut s.cost, &mut s.choice, &|l, longest| {
            l + 4 >= longest
        })
    }),
    // The kernel's price pass: whole matches, lengths capped at 64, warp 0's 32 parts of 132
    // positions (the last 4), each run on 64 positions into the next; and other parts and
    // overlaps (512: one part a warp, run 190).
    ("price_whole_cap64", |_, m, s| {
        segmented_bytes(m, PAGE_SIZE, 0, 64, &mut s.cost, &mut s.choice)
    }),
    ("kernel_price", |_, m, s| {
        segmented_bytes(m, 132, 64, 64, &mut s.cost, &mut s.choice)
    }),
    // The kernel's pass weighing lengths up to 128 or 255 (runs 212-218: with the search's
    // best measured on past 64 bytes, 128 gained the kernel 0.1-0.3 % on compiler heaps).
    ("kernel_price_cap128", |_, m, s| {
        segmented_bytes(m, 132, 64, 128, &mut s.cost, &mut s.choice)
    }),
    ("kernel_price_cap255", |_, m, s| {
        segmented_bytes(m, 132, 64, 255, &mut s.cost, &mut s.choice)
    }),
    ("price_parts_512", |_, m, s| {
        segmented_bytes(m, 512, 64, 64, &mut s.cost, &mut s.choice)
    }),
    ("price_parts_512_no_overlap", |_, m, s| {
        segmented_bytes(m, 512, 0, 64, &mut s.cost, &mut s.choice)
    }),
];

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("parse_model: {e}");
            std::process::exit(2);
        }
    };
    let stored = |n: usize| {
        if n == 0 || n >= args.threshold {
            PAGE_SIZE
        } else {
            n
        }
    };
    let mut m = Matches::new();
    let mut scratch = Scratch {
        cost: vec![0; PAGE_SIZE + 1],
        choice: vec![0; PAGE_SIZE + 1],
    };
    let mut out = vec![0u8; PAGE_SIZE + 64];
    for path in &args.corpora {
        let name = common::corpus_name(path);
        let pages = common::load_pages(path);
        let pages: Vec<&[u8]> = pages
            .chunks_exact(PAGE_SIZE)
            .filter(|&p| same_filled_word(p.try_into().expect("a page")).is_none())
            .take(args.pages)
            .collect();
        let raw = (pages.len() * PAGE_SIZE) as f64;
        let mut refs = [0usize; 3];
        for page in &pages {
            refs[0] += stored(common::liblz4_compress(page, None, &mut out));
            refs[1] += stored(common::liblz4_compress(page, Some(9), &mut out));
            refs[2] += stored(common::liblz4_compress(page, Some(12), &mut out));
        }
        for &depth in &args.depths {
            let samples = &args.samples;
            let patterns = &args.patterns;
            for (&long, &pattern, &sample) in args.long_depths.iter().flat_map(|l| {
                patterns
                    .iter()
                    .flat_map(move |p| samples.iter().map(move |s| (l, p, s)))
            }) {
                let mut bytes = [0usize; PARSES.len()];
                m.steps = 0;
                m.measured = 0;
                let mut deep = Matches::new();
                let mut marks = vec![false; PAGE_SIZE];
                let mut two_steps = 0u64;
                for page in &pages {
                    let how = |depth: usize| Search {
                        depth,
                        long,
                        cap: args.search_cap,
                        pattern,
                        sample,
                        inherit: args.inherit,
                    };
                    match args.two_phase {
                        Some(first) => {
                            // The kernel's second phase starts each marked position's walk
                            // over from its chain's head: its steps are the full walk's.
                            // Every marked position walks in the kernel's second phase,
                            // also one that took over its sample's match in the first; the
                            // longer of the two phases' matches stays.
                            deep.search(
                                page,
                                &Search {
                                    sample: 1,
                                    ..how(depth)
                                },
                            );
                            m.search(page, &how(first));
                            two_steps += m.steps;
                            m.steps = 0;
                            deep_marks(&m, args.path, args.near, &mut scratch, &mut marks);
                            for (q, &marked) in marks.iter().enumerate().take(LAST_START + 1) {
                                if !marked || m.len[q] >= 64 {
                                    continue;
                                }
                                two_steps += u64::from(deep.pos_steps[q]);
                                if deep.len[q] > m.len[q] {
                                    m.len[q] = deep.len[q];
                                    m.off[q] = deep.off[q];
                                }
                            }
                        }
                        None => m.search(page, &how(depth)),
                    }
                    for (total, (_, parse)) in bytes.iter_mut().zip(PARSES.iter()) {
                        *total += stored(parse(page, &m, &mut scratch));
                    }
                }
                if args.two_phase.is_some() {
                    m.steps = two_steps;
                }
                let vs_hc9: Vec<String> = PARSES
                    .iter()
                    .zip(bytes)
                    .map(|((name, _), n)| format!("\"{name}\":{:.4}", refs[1] as f64 / n as f64))
                    .collect();
                println!(
                    "{{\"corpus\":\"{name}\",\"pages\":{},\"depth\":{depth},\"long_depth\":{long},\"pattern\":{pattern},\"sample\":{sample},\"inherit\":{},\"two_phase\":{},\"steps_per_page\":{:.0},\"measured_per_page\":{:.0},\"lz4\":{:.4},\"hc9\":{:.4},\"hc12\":{:.4},\"vs_hc9\":{{{}}}}}",
                    pages.len(),
                    args.inherit,
                    args.two_phase.map_or("null".to_string(), |a| format!(
                        "{{\"first_depth\":{a},\"near\":{},\"path\":\"{}\"}}",
                        args.near,
                        args.path.name()
                    )),
                    m.steps as f64 / pages.len() as f64,
                    m.measured as f64 / pages.len() as f64,
                    raw / refs[0] as f64,
                    raw / refs[1] as f64,
                    raw / refs[2] as f64,
                    vs_hc9.join(","),
                );
            }
        }
    }
}
