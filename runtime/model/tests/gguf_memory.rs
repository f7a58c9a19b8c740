//! Peak heap memory while parsing a GGUF header with large metadata arrays, measured by a counting
//! global allocator in this test binary (one test only, so no other test's allocations interleave).
//!
//! The file: 20 million u8 in one array and 2 million short strings (1..=6 bytes) in another, about
//! 46 MB. The bound: the file is memory-mapped (not heap), a u8 array costs one byte per file byte,
//! and a string array costs its text plus one 8-byte end offset per string, which is exactly what the
//! file spends on it (8-byte length + text). So the parsed metadata is at most the file's size, and
//! the peak may be at most 1.25x the file's size plus 4 MiB (the slack covers the error-free path's
//! small allocations: the key strings, the B-tree, the test harness). A per-element representation
//! (a 32-byte enum per element, as before) peaks at about 15x; even a `Vec<String>` (24 bytes + text
//! per string) would exceed the bound.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

fn shrank(n: usize) {
    LIVE.fetch_sub(n, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // A moving realloc holds both blocks for a moment: count the new one before freeing the
            // old, so the peak is not underestimated.
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const N_U8: usize = 20_000_000;
const N_STR: usize = 2_000_000;

fn s(o: &mut impl Write, x: &str) {
    o.write_all(&(x.len() as u64).to_le_bytes()).unwrap();
    o.write_all(x.as_bytes()).unwrap();
}

#[test]
fn large_metadata_arrays_parse_within_the_file_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.gguf");
    {
        let mut o = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        o.write_all(b"GGUF").unwrap();
        o.write_all(&3u32.to_le_bytes()).unwrap();
        o.write_all(&0u64.to_le_bytes()).unwrap(); // tensors
        o.write_all(&2u64.to_le_bytes()).unwrap(); // kvs
        s(&mut o, "big.u8");
        o.write_all(&9u32.to_le_bytes()).unwrap();
        o.write_all(&0u32.to_le_bytes()).unwrap();
        o.write_all(&(N_U8 as u64).to_le_bytes()).unwrap();
        for i in 0..N_U8 {
            o.write_all(&[(i % 251) as u8]).unwrap();
        }
        s(&mut o, "big.strings");
        o.write_all(&9u32.to_le_bytes()).unwrap();
        o.write_all(&8u32.to_le_bytes()).unwrap();
        o.write_all(&(N_STR as u64).to_le_bytes()).unwrap();
        for i in 0..N_STR {
            s(&mut o, &format!("{i:x}"));
        }
        o.flush().unwrap();
    }
    let file_size = std::fs::metadata(&path).unwrap().len() as usize;

    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let g = metrale_model::gguf::GgufFile::open(&path).unwrap();
    let peak = PEAK.load(Ordering::SeqCst) - base;
    let held = LIVE.load(Ordering::SeqCst) - base;

    let bound = file_size + file_size / 4 + (4 << 20);
    eprintln!(
        "file {file_size} bytes; parse peak {peak} bytes ({:.2}x), held after parse {held} bytes; \
         bound {bound}",
        peak as f64 / file_size as f64
    );
    assert!(
        peak <= bound,
        "parsing a {file_size}-byte GGUF peaked at {peak} heap bytes, above the bound {bound}"
    );

    // the getters still see every element
    let strs = g.opt_str_array("big.strings").unwrap().unwrap();
    assert_eq!(strs.len(), N_STR);
    assert_eq!((strs[0], strs[255], strs[N_STR - 1]), ("0", "ff", "1e847f"));
    drop(strs);
    let bytes = g.opt_int_array("big.u8").unwrap().unwrap();
    assert_eq!(bytes.len(), N_U8);
    assert_eq!((bytes[0], bytes[250], bytes[251]), (0, 250, 0));
}
