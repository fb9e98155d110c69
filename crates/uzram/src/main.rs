//! The `uzram` binary: CLI, daemon and control plane.

mod bench;
mod cli;
mod cmd;
mod config;
mod control;
mod daemon;
mod devname;
mod footprint;
#[cfg(test)]
mod fuzz_tests;
mod hibernate;
mod inuse;
mod memory;
mod metrics;
mod pinned_log;
mod shm;
mod size;
mod sizeexpr;
mod stdio_route;
mod sys;
mod takeover;
mod ublk;

use std::process::ExitCode;

use clap::Parser;

/// 64 KiB blocks (the page store's arena segments) come from a pre-faulted pool while serving.
#[global_allocator]
static ALLOC: memory::pool::PoolAlloc = memory::pool::PoolAlloc;

fn main() -> ExitCode {
    // Before any thread exists (std reads it at the first spawn): threads started with
    // `std::thread::spawn`, libublk's queue threads among them, get 1 MiB stacks instead of
    // Rust's 2 MiB. A daemon populates and locks every thread's whole stack, and a queue
    // thread's deepest path is a fraction of the 512 KiB it faults in up front
    // (`memory::fault_guard`): the other MiB of each was locked memory for nothing, and a
    // takeover faulted it in during its pause. A larger value in the environment is kept; a
    // smaller one is not (a queue thread's prefault would run past its stack).
    let asked = std::env::var("RUST_MIN_STACK")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    if asked.is_none_or(|n| n < memory::fault_guard::DEFAULT_STACK) {
        std::env::set_var(
            "RUST_MIN_STACK",
            memory::fault_guard::DEFAULT_STACK.to_string(),
        );
    }
    // Before any thread exists: with threads already running, glibc may have given one its own
    // malloc arena, and later threads (the daemon's queue threads) can be handed that arena,
    // whose heap grows by fresh page faults outside the daemon's pre-grown headroom (seen in
    // the guest: a queue thread stuck faulting in such a heap under memory pressure).
    let malloc_configured = memory::reserve::configure_malloc();
    let cli = cli::Cli::parse_from(cli::args_with_generator_name(std::env::args_os()));
    // Before any thread exists too, so that every thread inherits it, the log writer's
    // included: a daemon thread whose reclaim queues swap writes can wait for its own device
    // forever. After a kill -9 under memory pressure, the dying daemon's log
    // thread allocated in do_exit, reclaimed into a swap write to the very device, and the
    // process never died, so no recovery could start. Every `daemon::serve` runs under one of
    // these commands. So does `recover`: while the device is paused, a swap write to it waits
    // for the daemon that `recover` has yet to start (and that daemon, forked from it,
    // inherits the flag through exec).
    let on_io_path = cli.command.on_a_device_io_path();
    let io_flusher = on_io_path.then(sys::set_io_flusher);
    // No core file of swapped memory, and no crash stuck in a dump: see `forbid_core_dumps`.
    let no_dumps = on_io_path.then(sys::forbid_core_dumps);
    // Log lines go through a bounded queue to a writer thread, and are dropped when it is
    // full: a queue thread must never block on a log write. The daemon's log file lives on
    // tmpfs (/run), whose pages can be swapped out to the daemon's own device; a queue
    // thread writing there would wait for its own swap-in (seen in the guest).
    // The writer thread must never take a daemon's SIGTERM (see `with_stop_signals_blocked`).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // On a device's I/O path the writer gets a copy of stderr of its own, and stderr itself
    // (with stdout where it is the log too) is routed into the queue: see `stdio_route`.
    let log_file = on_io_path
        .then(|| sys::dup_cloexec(2).ok())
        .flatten()
        .map(std::fs::File::from);
    let routed = log_file.is_some();
    // A log file's last page is kept in memory: see `pinned_log`.
    let (log_destination, unpinned): (Box<dyn std::io::Write + Send>, _) = match log_file {
        Some(file) => {
            let (log, err) = pinned_log::PinnedLog::new(file);
            (Box::new(log), err)
        }
        None => (Box::new(std::io::stderr()), None),
    };
    let (log_writer, _log_guard) = sys::with_stop_signals_blocked(|| {
        tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(true)
            .buffered_lines_limit(4096)
            .thread_name("uzram-log")
            .finish(log_destination)
    });
    // Declared after the guard, so dropped before it: what the drainer forwards at the end
    // reaches the queue before the guard flushes it.
    let stdio_route = routed.then(|| {
        let fds: &[i32] = if cli.command.stdout_is_its_log() {
            &[1, 2]
        } else {
            &[2]
        };
        stdio_route::install(fds, log_writer.clone())
    });
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("UZRAM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(log_writer)
        .with_ansi(ansi)
        .init();
    let _stdio_route = match stdio_route {
        Some(Ok(route)) => Some(route),
        Some(Err(err)) => {
            tracing::warn!(error = %err, "stderr goes straight to the log: a takeover may wait on it");
            None
        }
        None => None,
    };
    if let Some(err) = unpinned {
        tracing::warn!(error = %err, "{}", pinned_log::UNPINNED);
    }
    if !malloc_configured {
        tracing::warn!("mallopt failed: memory headroom may not hold under pressure");
    }
    if let Some(Err(err)) = no_dumps {
        tracing::warn!(error = %err, "PR_SET_DUMPABLE failed: a crash may write swapped memory to a core file");
    }
    // Without root the command stops at its own root check, which says what to do.
    if let (Some(Err(err)), true) = (io_flusher, sys::is_root()) {
        tracing::warn!(error = %err, "PR_SET_IO_FLUSHER failed: {}", io_flusher_failure(&err));
    }
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("uzram: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// What a failed `PR_SET_IO_FLUSHER` means, and what to do about it.
fn io_flusher_failure(err: &std::io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::EPERM) => "uzram runs as root without CAP_SYS_RESOURCE (a container, or a \
                              unit's CapabilityBoundingSet= without it): under memory pressure \
                              its allocations may wait on its own device's writes; give it \
                              that capability"
            .into(),
        Some(libc::EINVAL) => "the kernel is older than 5.6".into(),
        _ => err.to_string(),
    }
}

fn run(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    use cli::Command;
    match cli.command {
        Command::Create(args) => cmd::create::run(args),
        Command::Destroy(args) => cmd::destroy::run(args),
        Command::Recover(args) => cmd::recover::run(args),
        Command::List(args) => cmd::list::run(args),
        Command::Status(args) => cmd::status::run(args),
        Command::Run(args) => cmd::run::run(args),
        Command::SwapOn(args) => cmd::swap::on(args),
        Command::SwapOff(args) => cmd::swap::off(args),
        Command::CheckConfig(args) => cmd::check::run(args),
        Command::Idle(args) => cmd::tier::idle(args),
        Command::Recompress(args) => cmd::tier::recompress(args),
        Command::Writeback(args) => cmd::tier::writeback(args),
        Command::Generator(args) => cmd::generator::run(args),
        Command::Completions(args) => cmd::docs::completions(args),
        Command::Man(args) => cmd::docs::man(args),
        Command::Daemon(args) => cmd::daemon::run(args),
        Command::Standby(args) => cmd::run::standby(args),
        Command::Bench(args) => bench::run(args),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn io_flusher_failure_names_its_cause() {
        let of = |errno| super::io_flusher_failure(&std::io::Error::from_raw_os_error(errno));
        assert!(of(libc::EPERM).contains("CAP_SYS_RESOURCE"));
        assert!(!of(libc::EPERM).contains("5.6"));
        assert!(of(libc::EINVAL).contains("older than 5.6"));
        assert_eq!(
            of(libc::ENOMEM),
            std::io::Error::from_raw_os_error(libc::ENOMEM).to_string()
        );
    }
}
