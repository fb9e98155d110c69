//! A ublk device that stores nothing: every request completes at once, with the byte count the
//! kernel asked for. It is the floor of any ublk server's cost, the transport alone: the
//! kernel's round trip to a queue thread and back, and ublk's copy of each request's data
//! between the bio and the thread's buffer.
//!
//! Why it exists: the guest benchmark (`tests/e2e/bench.sh`, part `null`) runs the same fio
//! jobs on it as on zram.ko and on uzram, in the same boot, so the tables can say how much of
//! uzram's distance from zram is the transport's and how much is the daemon's own work. It
//! sets its device up as uzram does (the same parameters, queue depth, I/O buffer size and
//! tuned io_uring rings) and serves it in uzram's `per-queue` mode or, with `--batch`, its
//! `batch` mode (`UBLK_F_BATCH_IO`, Linux 7.0), so only the work per request differs. Its
//! queue threads keep the default priority, unlike uzram's (nice -20): in the guest a build at
//! nice -20 served a third as many 4K reads at queue depth 32 (the transport's floor, docs/bench/),
//! and a floor is the best a server can do.
//!
//! It also holds a crash's case for the guest's scenario q: with `--hold` the device is made for
//! user recovery (as uzram's are) and its queue threads take every request past the first MiB
//! and never complete one, so that a `kill -9` leaves a queue whose every request the dead
//! server held (the first MiB is served: the kernel reads it for partitions as the device
//! starts);
//! `--state ID` prints what the kernel says of device ID (`LIVE`, `QUIESCED`, ...) and
//! `--delete ID` deletes it.
//!
//! Usage: `ublk_null [--batch] [--hold] [--queues N] [--depth D] [--size-mib M]`; prints
//! `/dev/ublkbID` once the device serves, and deletes it on SIGTERM or SIGINT;
//! `ublk_null --state ID`, `ublk_null --delete ID`. Needs root and `ublk_drv`.

use std::io::Write;

use clap::Parser;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{
    BufDescList, UblkBatchBuffers, UblkBatchCompletion, UblkBatchConfig, UblkBatchQueue, UblkDev,
    UblkIOCtx, UblkQueue,
};
use libublk::{sys, BufDesc, UblkError, UblkFlags, UblkIORes};

/// uzram's queue rings (`COOP_TASKRUN | SINGLE_ISSUER | DEFER_TASKRUN`, or `COOP_TASKRUN`
/// alone where the kernel refuses those): the daemon's own module, so both set up the same ring.
#[allow(dead_code)]
#[path = "../src/ublk/uring.rs"]
mod ring;

/// uzram's largest request (`footprint::IO_BUF_BYTES`).
const IO_BUF_BYTES: u32 = 128 << 10;
const SECTOR_SHIFT: u32 = 9;
const PAGE_SHIFT: u8 = 12;
/// `--hold` serves the first MiB (the partition scan's reads) and holds the rest.
const HOLD_FROM_SECTOR: u64 = (1 << 20) >> SECTOR_SHIFT;

#[derive(Parser)]
#[command(about = "A ublk device that stores nothing (the transport's floor, for benchmarks)")]
struct Args {
    /// Batched fetch and commit (`UBLK_F_BATCH_IO`, Linux 7.0), as uzram's `batch` mode.
    #[arg(long)]
    batch: bool,
    /// Hardware queues, one thread each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    queues: u16,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4096))]
    depth: u16,
    /// Device size in MiB.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    size_mib: u64,
    /// Take every request past the first MiB and complete none, on a device made for user
    /// recovery (per-queue loop only): after a `kill -9` the device waits for a new server.
    #[arg(long, conflicts_with = "batch")]
    hold: bool,
    /// Print the kernel's state of device ID (LIVE, QUIESCED, ...) and exit.
    #[arg(long, value_name = "ID", conflicts_with_all = ["batch", "hold", "delete"])]
    state: Option<u32>,
    /// Delete device ID (one whose server is gone) and exit.
    #[arg(long, value_name = "ID", conflicts_with_all = ["batch", "hold"])]
    delete: Option<u32>,
}

/// `--state ID`: the kernel's state of device `id`, as a word.
fn state_of(id: u32) -> anyhow::Result<&'static str> {
    let ctrl = UblkCtrl::new_simple(id as i32)
        .map_err(|err| anyhow::anyhow!("opening ublk device {id}: {err}"))?;
    Ok(match u32::from(ctrl.dev_info().state) {
        sys::UBLK_S_DEV_DEAD => "DEAD",
        sys::UBLK_S_DEV_LIVE => "LIVE",
        sys::UBLK_S_DEV_QUIESCED => "QUIESCED",
        _ => "OTHER",
    })
}

/// uzram's device parameters, less discard: 4 KiB blocks, requests up to 128 KiB.
fn params(size: u64) -> sys::ublk_params {
    sys::ublk_params {
        types: sys::UBLK_PARAM_TYPE_BASIC,
        basic: sys::ublk_param_basic {
            logical_bs_shift: PAGE_SHIFT,
            physical_bs_shift: PAGE_SHIFT,
            io_opt_shift: PAGE_SHIFT,
            io_min_shift: PAGE_SHIFT,
            max_sectors: IO_BUF_BYTES >> SECTOR_SHIFT,
            dev_sectors: size >> SECTOR_SHIFT,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// What a request completes with: reads and writes their length (a read returns whatever the
/// buffer held), anything else 0.
fn result(iod: &sys::ublksrv_io_desc) -> i32 {
    match iod.op_flags & 0xff {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE => (iod.nr_sectors << SECTOR_SHIFT) as i32,
        _ => 0,
    }
}

/// Serves queue `qid` until the device stops, in the mode `batch` says (or holds every
/// request, `hold`).
fn serve(qid: u16, dev: &UblkDev, batch: bool, hold: bool) {
    if let Err(err) = ring::init_queue_ring(dev.tgt.sq_depth.into(), dev.tgt.cq_depth.into()) {
        eprintln!("ublk_null: queue {qid}: io_uring setup failed: {err}");
        return;
    }
    let queue = match UblkQueue::new(qid, dev) {
        Ok(q) => q,
        Err(err) => {
            eprintln!("ublk_null: queue {qid}: {err}");
            return;
        }
    };
    let served = if batch {
        serve_batch(&queue, dev)
    } else {
        serve_per_request(queue, dev, hold)
    };
    if let Err(err) = served {
        eprintln!("ublk_null: queue {qid}: {err}");
    }
}

/// uzram's `per-queue` loop: one FETCH / COMMIT_AND_FETCH command per request.
fn serve_per_request(queue: UblkQueue<'_>, dev: &UblkDev, hold: bool) -> Result<(), UblkError> {
    let bufs = dev.alloc_queue_io_bufs();
    let queue = queue.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs)))?;
    queue.wait_and_handle_io(|q: &UblkQueue, tag: u16, _io: &UblkIOCtx| {
        if hold && q.get_iod(tag).start_sector >= HOLD_FROM_SECTOR {
            return;
        }
        let res = result(q.get_iod(tag));
        let buf = BufDesc::Slice(bufs[usize::from(tag)].as_slice());
        if let Err(err) = q.complete_io_cmd_unified(tag, buf, Ok(UblkIORes::Result(res))) {
            eprintln!("ublk_null: completing tag {tag}: {err}");
        }
    });
    Ok(())
}

/// uzram's `batch` loop (`ublk/batch.rs`): multishot fetches of request groups, one
/// commit command for every result of a wake-up.
fn serve_batch(queue: &UblkQueue<'_>, dev: &UblkDev) -> Result<(), UblkError> {
    let depth = queue.get_depth() as usize;
    let config = UblkBatchConfig::new()
        .with_tags_per_fetch_buffer(u16::try_from(depth).unwrap_or(u16::MAX).max(1));
    let bufs = UblkBatchBuffers::IoBufs(dev.alloc_queue_io_bufs());
    let mut batch = UblkBatchQueue::new(queue, bufs, config)?;
    let mut pending: Vec<UblkBatchCompletion> = Vec::with_capacity(depth);
    loop {
        let mut failed = None;
        let waited = queue.flush_and_wake_io_tasks(
            |_user_data, cqe, _last| {
                let served = batch.handle_cqe(cqe, |_batch, tags| {
                    pending.extend(
                        tags.iter()
                            .map(|&tag| UblkBatchCompletion::new(tag, result(queue.get_iod(tag)))),
                    );
                    Ok(())
                });
                if let Err(err) = served {
                    failed.get_or_insert(err);
                }
            },
            1,
        );
        match waited {
            Ok(_) => {}
            Err(UblkError::QueueIsDown) => return Ok(()),
            Err(err) => return Err(err),
        }
        if let Some(err) = failed {
            return Err(err);
        }
        if !pending.is_empty() && batch.try_submit_completions(&pending)? {
            pending.clear();
        }
        if batch.try_begin_shutdown()? && batch.is_shutdown_complete() {
            return Ok(());
        }
    }
}

/// Blocks SIGTERM and SIGINT in this thread (and so in every thread started after) and returns
/// them as a set for `sigwait`.
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset initializes the set before any other use; sigaddset and
    // pthread_sigmask take pointers to that initialized local set only.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(id) = args.state {
        println!("{}", state_of(id)?);
        return Ok(());
    }
    if let Some(id) = args.delete {
        UblkCtrl::new_simple(id as i32)
            .and_then(|c| c.del_dev())
            .map_err(|err| anyhow::anyhow!("deleting ublk device {id}: {err}"))?;
        return Ok(());
    }
    // A kernel without UBLK_F_BATCH_IO drops the flag and adds a device that no batch queue
    // can serve, so the refusal comes here, before the device exists.
    if args.batch {
        match UblkCtrl::get_features() {
            Some(features) if features & u64::from(sys::UBLK_F_BATCH_IO) != 0 => {}
            Some(features) => anyhow::bail!(
                "--batch needs UBLK_F_BATCH_IO (Linux 7.0+); this kernel's ublk driver offers \
                 features {features:#x} without it: run without --batch"
            ),
            None => anyhow::bail!(
                "cannot read the ublk driver's features (is ublk_drv loaded? `modprobe ublk_drv`)"
            ),
        }
    }
    let signals = block_stop_signals();
    let ctrl = UblkCtrlBuilder::default()
        .name("uzram-null")
        .id(-1)
        .nr_queues(args.queues)
        .depth(args.depth)
        .io_buf_bytes(IO_BUF_BYTES)
        .ctrl_flags(if args.batch {
            sys::UBLK_F_BATCH_IO as u64
        } else if args.hold {
            u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE)
        } else {
            0
        })
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build()
        .map_err(|err| anyhow::anyhow!("adding the device (is ublk_drv loaded?): {err}"))?;
    let id = ctrl.dev_info().dev_id;
    // The stop: on a signal, stop the device, which ends the queues and `run_target`; the
    // control's drop then deletes it.
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: sigwait reads the initialized set and writes one int we own.
        unsafe { libc::sigwait(&signals, &mut sig) };
        if let Err(err) = UblkCtrl::new_simple(id as i32).and_then(|c| c.kill_dev()) {
            eprintln!("ublk_null: stopping /dev/ublkb{id}: {err}");
        }
    });
    let size = args.size_mib << 20;
    let (batch, hold) = (args.batch, args.hold);
    ctrl.run_target(
        |dev: &mut UblkDev| {
            dev.tgt.dev_size = size;
            dev.tgt.params = params(size);
            Ok(())
        },
        move |qid, dev: &UblkDev| serve(qid, dev, batch, hold),
        move |_: &UblkCtrl| {
            println!("/dev/ublkb{id}");
            let _ = std::io::stdout().flush();
        },
    )
    .map_err(|err| anyhow::anyhow!("serving /dev/ublkb{id}: {err}"))?;
    Ok(())
}
