//! `swapoff` with progress: reading every swapped-out page back into RAM can take minutes on
//! a large device, so `uzram swap-off` (and the unit's stop, which runs it) shows the pages
//! left, the rate and the time to go: a bar redrawn on a terminal, a line every few seconds
//! otherwise (the journal, under systemd). The pages left are the device's `Used` in
//! `/proc/swaps`.

use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::inuse::swap_usage;
use crate::size::format_size;

/// How often the bar is redrawn on a terminal.
const TTY_EVERY: Duration = Duration::from_millis(250);
/// How often a line is logged when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);
/// The rate is measured over this much of the recent past.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Runs `swapoff dev`, reporting progress on stderr until it exits.
pub fn run(dev: &str) -> anyhow::Result<()> {
    let start = Instant::now();
    let used_kib = |now| swap_usage(dev).ok().flatten().map(|(_, used)| (now, used));
    let mut meter = Meter::new(used_kib(start).map_or(0, |(_, u)| u));
    let mut child = Command::new("swapoff")
        .arg(dev)
        .spawn()
        .with_context(|| format!("running swapoff {dev}"))?;
    let tty = std::io::stderr().is_terminal();
    let every = if tty { TTY_EVERY } else { LOG_EVERY };
    let mut shown = start;
    let mut drew = false;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for swapoff")? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
        let now = Instant::now();
        if now.duration_since(shown) < every {
            continue;
        }
        shown = now;
        if let Some((at, used)) = used_kib(now) {
            meter.sample(at, used);
        }
        let line = meter.line(dev, now.duration_since(start));
        let mut err = std::io::stderr().lock();
        if tty {
            let _ = write!(err, "\r\x1b[K{} {line}", meter.bar(30));
            drew = true;
        } else {
            let _ = writeln!(err, "uzram: {line}");
        }
    };
    let mut err = std::io::stderr().lock();
    if drew {
        let _ = writeln!(err);
    }
    if !status.success() {
        anyhow::bail!("swapoff {dev} failed: {status}");
    }
    let took = start.elapsed();
    if took >= every {
        let _ = writeln!(
            err,
            "uzram: swapoff {dev}: {} read back in {:.1} s",
            format_size(meter.total_kib * 1024),
            took.as_secs_f64()
        );
    }
    Ok(())
}

/// Pages left over time, and what they say about the rate and the time to go.
#[derive(Debug)]
struct Meter {
    /// Used KiB when swapoff started.
    total_kib: u64,
    samples: VecDeque<(Instant, u64)>,
}

impl Meter {
    fn new(total_kib: u64) -> Meter {
        Meter {
            total_kib,
            samples: VecDeque::new(),
        }
    }

    fn sample(&mut self, at: Instant, used_kib: u64) {
        self.samples.push_back((at, used_kib));
        while let Some(&(first, _)) = self.samples.front() {
            if self.samples.len() > 2 && at.duration_since(first) > RATE_WINDOW {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }

    fn left_kib(&self) -> u64 {
        self.samples.back().map_or(self.total_kib, |&(_, u)| u)
    }

    /// KiB read back per second over the window; `None` before two samples.
    fn rate_kib_s(&self) -> Option<f64> {
        let (&(t0, u0), &(t1, u1)) = (self.samples.front()?, self.samples.back()?);
        let secs = t1.duration_since(t0).as_secs_f64();
        (secs > 0.0).then(|| u0.saturating_sub(u1) as f64 / secs)
    }

    fn done_fraction(&self) -> f64 {
        if self.total_kib == 0 {
            return 1.0;
        }
        1.0 - self.left_kib().min(self.total_kib) as f64 / self.total_kib as f64
    }

    fn bar(&self, width: usize) -> String {
        let done = ((self.done_fraction() * width as f64).round() as usize).min(width);
        format!("[{}{}]", "#".repeat(done), "-".repeat(width - done))
    }

    fn line(&self, dev: &str, elapsed: Duration) -> String {
        let left = self.left_kib();
        let mut line = format!(
            "swapoff {dev}: {} of {} left ({:.0} %)",
            format_size(left * 1024),
            format_size(self.total_kib * 1024),
            self.done_fraction() * 100.0
        );
        match self.rate_kib_s() {
            Some(rate) if rate > 0.0 => {
                let eta = left as f64 / rate;
                line.push_str(&format!(
                    ", {}/s, about {} to go",
                    format_size((rate * 1024.0) as u64),
                    human_secs(eta)
                ));
            }
            Some(_) => line.push_str(", no pages came back in the last seconds"),
            None => {}
        }
        line.push_str(&format!(" ({} so far)", human_secs(elapsed.as_secs_f64())));
        line
    }
}

fn human_secs(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..=99 => format!("{s} s"),
        100..=5999 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meter_says_what_is_left_how_fast_and_how_long() {
        let t0 = Instant::now();
        let mut m = Meter::new(4 << 20); // 4 GiB used at the start
        assert_eq!(m.bar(10), "[----------]");
        m.sample(t0, 4 << 20);
        let line = m.line("/dev/ublkb0", Duration::ZERO);
        assert!(line.contains("4G of 4G left (0 %)"), "{line}");
        assert!(!line.contains("to go"), "no rate from one sample: {line}");
        // 1 GiB back in 2 s: 512 MiB/s, 3 GiB left, 6 s to go.
        m.sample(t0 + Duration::from_secs(2), 3 << 20);
        let line = m.line("/dev/ublkb0", Duration::from_secs(2));
        assert!(line.contains("3G of 4G left (25 %)"), "{line}");
        assert!(line.contains("512M/s, about 6 s to go"), "{line}");
        assert_eq!(m.bar(8), "[##------]");
        // stalled: no progress over the window
        let mut s = Meter::new(100);
        s.sample(t0, 100);
        s.sample(t0 + Duration::from_secs(5), 100);
        assert!(s
            .line("d", Duration::from_secs(5))
            .contains("no pages came back"));
    }

    #[test]
    fn the_rate_is_taken_over_the_recent_window() {
        let t0 = Instant::now();
        let mut m = Meter::new(1000);
        for i in 0..30u64 {
            // fast at first (100 KiB/s), then 10 KiB/s from second 10 on
            let used = if i < 10 {
                1000 - 100 * i / 2
            } else {
                500 - 10 * (i - 10)
            };
            m.sample(t0 + Duration::from_secs(i), used);
        }
        let rate = m.rate_kib_s().unwrap();
        assert!((rate - 10.0).abs() < 0.5, "{rate}");
    }

    #[test]
    fn durations_read_as_a_person_would_say_them() {
        assert_eq!(human_secs(4.4), "4 s");
        assert_eq!(human_secs(125.0), "2 min 5 s");
        assert_eq!(human_secs(7300.0), "2 h 1 min");
    }
}
