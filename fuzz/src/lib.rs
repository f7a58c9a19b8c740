//! Shared by metrale's fuzz targets: a counting global allocator that bounds memory.
//!
//! Owns: [`measure`], the heap peak (bytes above what was live before) of one call, so a target can
//! assert its parser's bound (e.g. the GGUF header parser: at most 8x the input plus 64 KiB), and a
//! hard cap on live heap for the whole process ([`HARD_CAP`]): an allocation that would pass it
//! aborts with a message, which libFuzzer reports as a crash with the input saved. This works
//! without a sanitizer (libFuzzer's own -malloc_limit_mb needs one) and counts what Rust allocates.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Live heap above which the process aborts: far above what any target needs for a fuzz-sized
/// input (at most a few MiB), far below the machine.
pub const HARD_CAP: usize = 512 << 20;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

pub struct Counting;

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
    if now > HARD_CAP {
        // no allocation here: stderr is unbuffered and the message is static
        let _ = std::io::stderr().write_all(
            b"metrale-fuzz: live heap passed HARD_CAP (512 MiB): unbounded allocation\n",
        );
        std::process::abort();
    }
}

fn shrank(n: usize) {
    LIVE.fetch_sub(n, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            shrank(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            shrank(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // a moving realloc holds both blocks for a moment
        grew(new_size);
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            shrank(new_size);
        } else {
            shrank(layout.size());
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Run `f` and return its result and the heap peak it reached above what was live before it.
/// libFuzzer runs one input at a time on one thread, so the peak is `f`'s own.
pub fn measure<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = f();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (r, peak)
}
