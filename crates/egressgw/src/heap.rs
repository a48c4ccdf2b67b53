//! Giving the heap's free memory back to the system, paced.
//!
//! glibc gives back only the free memory at the top of each heap. A
//! daemon that plans a large cluster frees most of what each plan built
//! while the stores' objects it keeps stay live in between, so without help
//! its resident memory stays near the largest it ever held: a gateway
//! node's agent at 200 nodes held 137 MiB of which a third was free heap,
//! and 95 MiB after one `malloc_trim` ([`egressgw_common::heap`]). A
//! daemon marks each burst of work with [`Trim::worked`] and calls
//! [`Trim::tick`] from its loop: the free memory goes back at most once
//! every [`TRIM_EVERY`] after work, never while idle.

use std::time::{Duration, Instant};

/// How often the heap is trimmed at most. A trim walks every free chunk
/// while the allocator's other callers wait, so it is not run after every
/// reconcile of a busy node.
pub const TRIM_EVERY: Duration = Duration::from_secs(5);

/// When the heap is next trimmed.
#[derive(Debug)]
pub struct Trim {
    every: Duration,
    /// When the heap was last trimmed.
    last: Option<Instant>,
    /// Work done since then.
    owed: bool,
}

impl Default for Trim {
    fn default() -> Self {
        Self::every(TRIM_EVERY)
    }
}

impl Trim {
    pub fn every(every: Duration) -> Self {
        Self {
            every,
            last: None,
            owed: false,
        }
    }

    /// Marks work that may have freed memory.
    pub fn worked(&mut self) {
        self.owed = true;
    }

    /// Whether a trim is due at `now`: there was work since the last one,
    /// which was at least [`Trim::every`] ago.
    pub fn due(&self, now: Instant) -> bool {
        self.owed
            && self
                .last
                .is_none_or(|last| now.saturating_duration_since(last) >= self.every)
    }

    /// Trims the heap if that is due.
    pub fn tick(&mut self) {
        let now = Instant::now();
        if !self.due(now) {
            return;
        }
        let released = egressgw_common::heap::give_back();
        self.last = Some(now);
        self.owed = false;
        tracing::debug!(released, took = ?now.elapsed(), "heap trimmed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_is_due_only_after_work_and_at_most_once_per_period() {
        let mut trim = Trim::every(Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(!trim.due(t0), "nothing was done yet");
        trim.worked();
        assert!(trim.due(t0), "the first work is trimmed after at once");
        trim.tick();
        assert!(!trim.due(Instant::now()), "nothing was done since");
        trim.worked();
        let last = trim.last.expect("trimmed");
        assert!(!trim.due(last + Duration::from_secs(4)), "too soon");
        assert!(trim.due(last + Duration::from_secs(5)));
        trim.tick();
        assert!(trim.owed, "a tick before its time keeps the work owed");
    }

    /// The process's resident memory, in bytes.
    fn resident() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .unwrap()
            .unwrap();
        pages * u64::try_from(page).unwrap()
    }

    /// What a plan leaves: many small blocks freed between a few kept, so
    /// no free memory is at the top of the heap, where glibc gives it back
    /// by itself.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_free_memory_between_live_blocks_goes_back_to_the_system() {
        const BLOCK: usize = 16 << 10;
        const BLOCKS: usize = 6_000; // 96 MiB
        let mut blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8; BLOCK]).collect();
        let kept: Vec<Vec<u8>> = blocks.iter_mut().step_by(16).map(std::mem::take).collect();
        drop(blocks);
        let before = resident();
        assert!(egressgw_common::heap::give_back(), "nothing given back");
        let after = resident();
        let freed = (BLOCKS - kept.len()) * BLOCK;
        assert!(
            before.saturating_sub(after) > (freed / 2) as u64,
            "{} MiB freed, resident {} MiB before the trim and {} MiB after",
            freed >> 20,
            before >> 20,
            after >> 20
        );
        drop(kept);
    }
}
