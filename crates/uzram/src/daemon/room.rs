//! Room on demand under `mem-limit`: with a backing device, a write that finds the store at
//! its limit asks the room thread (`pressure.rs`) to write the oldest pages back now, waits
//! for the step that makes room, and tries again, instead of failing at once and leaving the
//! room to the next once-a-second pressure pass. Without a backing device, or when the pass
//! could free nothing (the day's budget spent, every page staged or same-filled), the write
//! still fails with ENOMEM, as zram's does at its limit.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The longest a write waits for room. The room thread answers after each step of its pass
/// that brings the store under 90 % of the limit. While a write waits, its queue serves
/// nothing else: a longer wait (10 s) stalled the whole device in one TCG run of scenario l
/// when the room thread did not answer, where 3 s let writes fail with ENOMEM (which the
/// kernel retries) and the hog finish.
pub const WAIT: Duration = Duration::from_secs(3);

/// Asks for room (writers) and answers them (the room thread).
#[derive(Debug, Default)]
pub struct Room {
    state: Mutex<Asks>,
    asked: Condvar,
    answered: Condvar,
}

#[derive(Debug, Default)]
struct Asks {
    /// Asks made so far.
    asked: u64,
    /// Asks that a pass started after has answered.
    answered: u64,
    /// Asks made before room was last made: room came after each of them, even where the
    /// pass that made it started earlier (its write found the limit mid-pass) and the pass
    /// that answers it then finds nothing left to do.
    made_upto: u64,
}

impl Room {
    fn lock(&self) -> MutexGuard<'_, Asks> {
        // Counters that are only ever raised: a panicked holder leaves them consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Asks for a room-making pass and waits up to `wait` for one that starts after this
    /// ask to answer. Returns whether it answered in time and room was made since the ask.
    pub fn ask(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut st = self.lock();
        st.asked += 1;
        let mine = st.asked;
        self.asked.notify_one();
        while st.answered < mine {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = wait_on(&self.answered, st, left);
        }
        st.made_upto >= mine
    }

    /// The room thread: waits up to `period` for an ask. Returns the asks to answer once
    /// the pass that follows has ended (0 when none came), for [`Room::answer`].
    pub fn wait(&self, period: Duration) -> u64 {
        let mut st = self.lock();
        if st.asked == st.answered {
            st = wait_on(&self.asked, st, period);
        }
        st.asked
    }

    /// Whether asks came that no pass has answered yet.
    pub fn pending(&self, seen: u64) -> bool {
        seen > self.lock().answered
    }

    /// A pass that started after ask `upto` made room (`made`: for every ask so far), or
    /// ended without: wakes its askers.
    pub fn answer(&self, upto: u64, made: bool) {
        let mut st = self.lock();
        if made {
            st.made_upto = st.asked;
        }
        if upto > st.answered {
            st.answered = upto;
            self.answered.notify_all();
        }
    }
}

/// Waits on `cv` for at most `wait`, through a poisoned lock too (see [`Room::lock`]).
fn wait_on<'a>(cv: &Condvar, st: MutexGuard<'a, Asks>, wait: Duration) -> MutexGuard<'a, Asks> {
    cv.wait_timeout(st, wait)
        .unwrap_or_else(PoisonError::into_inner)
        .0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn an_ask_waits_for_a_pass_that_starts_after_it() {
        let room = Arc::new(Room::default());
        // Nobody answers: the ask gives up at its deadline.
        let t = Instant::now();
        assert!(!room.ask(Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(50));
        // That unanswered ask is seen, and answered, by the next pass.
        let seen = room.wait(Duration::from_millis(1));
        assert_eq!(seen, 1);
        assert!(room.pending(seen));
        room.answer(seen, true);
        assert!(!room.pending(seen));

        // A room thread that answers each ask after its pass.
        let answerer = {
            let room = room.clone();
            std::thread::spawn(move || {
                let mut passes = 0;
                while passes < 4 {
                    let seen = room.wait(Duration::from_secs(5));
                    if room.pending(seen) {
                        passes += 1;
                        // The fourth pass finds nothing to write back.
                        room.answer(seen, passes < 4);
                    }
                }
            })
        };
        for _ in 0..3 {
            assert!(room.ask(Duration::from_secs(5)));
        }
        // Answered, but no room: the asker gives up at once rather than asking again.
        assert!(!room.ask(Duration::from_secs(5)));
        answerer.join().unwrap();
        // Answers never go back: an old ask number answers nothing new.
        room.answer(1, true);
        assert!(!room.pending(5));
    }

    /// A write that found the limit while a pass was still making room: that pass's room
    /// counts for it, though the pass that answers it finds nothing left to do (the daemon's
    /// backend gave up with ENOMEM on such writes before).
    #[test]
    fn room_made_after_an_ask_counts_though_its_own_pass_makes_none() {
        let room = Arc::new(Room::default());
        let seen = room.wait(Duration::from_millis(1));
        assert_eq!(seen, 0);
        let writer = {
            let room = room.clone();
            std::thread::spawn(move || room.ask(Duration::from_secs(5)))
        };
        // The pass under way makes room after the ask came (its early answer, for ask 0).
        while !room.pending(room.wait(Duration::from_millis(1))) {}
        room.answer(seen, true);
        // The next pass answers the ask and makes nothing: the writer still tries again.
        let next = room.wait(Duration::from_millis(1));
        room.answer(next, false);
        assert!(writer.join().unwrap());
        // An ask after the last room was made gets the truth: nothing.
        let late = {
            let room = room.clone();
            std::thread::spawn(move || room.ask(Duration::from_secs(5)))
        };
        while !room.pending(room.wait(Duration::from_millis(1))) {}
        let next = room.wait(Duration::from_millis(1));
        room.answer(next, false);
        assert!(!late.join().unwrap());
    }

    #[test]
    fn the_room_thread_wakes_at_an_ask_not_at_its_period() {
        let room = Arc::new(Room::default());
        let asker = {
            let room = room.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                room.ask(Duration::from_millis(10))
            })
        };
        let t = Instant::now();
        let seen = room.wait(Duration::from_secs(30));
        assert_eq!(seen, 1);
        assert!(t.elapsed() < Duration::from_secs(10));
        asker.join().unwrap();
    }
}
