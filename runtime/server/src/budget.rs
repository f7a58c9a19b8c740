//! The memory budget for request work: what the process may still allocate once the model is
//! loaded, and reservations that requests take against it *before* they allocate.
//!
//! The limit comes from, in order: `--max-memory`; the cgroup's `memory.max` (v2) or
//! `memory.limit_in_bytes` (v1); the address-space limit (`RLIMIT_AS`, e.g. `ulimit -v`); else the
//! memory available on the host. When the model is ready the server measures what it uses (resident
//! set, or address space under `RLIMIT_AS`, which counts reservations) and keeps a headroom for
//! connections and its own buffers; the rest is the budget.
//!
//! A request reserves its worst case before each stage that allocates in proportion to its input:
//! reading the body (2x its length: hyper's frames and the collected copy), parsing it
//! ([`parse_worst_case`]: per byte, plus per JSON value, counted by one scan of the bytes) and
//! tokenizing the prompt ([`TOKENIZE_BYTES_PER_BYTE`]). `tests/memory_bounds.rs` measures the heap's
//! peak on adversarial inputs and fails if a reservation does not cover it.
//! A worst case larger than the whole budget is a 413 naming the budget and its source; one that
//! does not fit beside the requests already reserved is a 429 with `Retry-After`.
//!
//! Invariant: the sum of live reservations never exceeds the budget; a reservation is released when
//! dropped, whatever way the request ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;

use crate::error::ApiError;

/// Peak heap bytes of tokenizing one byte of prompt text. The worst input measured (a chat turn of
/// digits: one token per byte, SmolLM2's tokenizer, special-token markup around it) peaks at 539
/// bytes per byte, counting the old and new blocks of a growing vector both live while it is
/// copied; 20 % more covers inputs not measured.
pub const TOKENIZE_BYTES_PER_BYTE: u64 = 640;

/// Heap bytes of parsing a request, per body byte (strings are copied out of the body, then into
/// the template's messages) ...
pub const PARSE_BYTES_PER_BYTE: u64 = 3;
/// ... and per JSON value (a struct, enum or `serde_json::Value` node each, with serde's buffer for
/// untagged enums).
pub const PARSE_BYTES_PER_VALUE: u64 = 160;

/// The most heap parsing `body` into any request type can take: every JSON value starts at the
/// body's start or after one of `[`, `{`, `,` or `:`, so counting those bounds the values.
pub fn parse_worst_case(body: &[u8]) -> u64 {
    let values = 1 + body
        .iter()
        .filter(|&&b| matches!(b, b'[' | b'{' | b',' | b':'))
        .count() as u64;
    body.len() as u64 * PARSE_BYTES_PER_BYTE + values * PARSE_BYTES_PER_VALUE
}

/// Bytes held while a body is read, per body byte (the frames, then the collected copy).
pub const BODY_BYTES_PER_BYTE: u64 = 2;

/// Where the limit came from, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag,
    Cgroup,
    AddressSpace,
    Host,
}

impl Source {
    fn describe(&self) -> &'static str {
        match self {
            Source::Flag => "--max-memory",
            Source::Cgroup => "the cgroup memory limit",
            Source::AddressSpace => "the address-space limit (RLIMIT_AS)",
            Source::Host => "the host's available memory",
        }
    }
}

/// The process's memory limit and what of it requests may reserve.
#[derive(Debug)]
pub struct MemoryBudget {
    pub source: Source,
    /// The limit itself, bytes.
    pub limit: u64,
    /// Bytes requests may reserve in all.
    pub total: u64,
    reserved: AtomicU64,
    /// The most ever reserved at once.
    peak: AtomicU64,
}

/// Bytes held against the budget; released on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0))
}

/// Parse a size such as `8G`, `512M`, `1.5GiB` or a byte count.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 8G, 512M, 1073741824)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("'{s}': unknown unit '{u}' (use K, M, G or T)")),
    };
    Ok((v * mult as f64) as u64)
}

/// A `/proc/self/status` field in bytes (`VmRSS`, `VmSize`).
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn cgroup_limit() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else {
            continue;
        };
        let v = std::fs::read_to_string(&file)
            .or_else(|_| {
                // Inside a container the cgroup's own directory is the mount's root.
                let name = file.rsplit('/').next().unwrap_or_default();
                let root = if controllers.is_empty() {
                    "/sys/fs/cgroup"
                } else {
                    "/sys/fs/cgroup/memory"
                };
                std::fs::read_to_string(format!("{root}/{name}"))
            })
            .ok()?;
        let v = v.trim();
        // "max" (v2) or a huge value (v1) is no limit.
        return v.parse::<u64>().ok().filter(|&n| n < (1 << 60));
    }
    None
}

fn address_space_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass and reads nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// `MemAvailable` of /proc/meminfo in bytes (None where it cannot be read).
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl MemoryBudget {
    /// Measure the budget now (call when the model is ready). `flag` is `--max-memory`;
    /// `headroom` is kept for connections and buffers that take no reservation.
    pub fn measure(flag: Option<u64>, headroom: u64) -> MemoryBudget {
        let rss = proc_status_bytes("VmRSS:").unwrap_or(0);
        let (source, limit, used) = if let Some(f) = flag {
            (Source::Flag, f, rss)
        } else if let Some(c) = cgroup_limit() {
            (Source::Cgroup, c, rss)
        } else if let Some(a) = address_space_limit() {
            (
                Source::AddressSpace,
                a,
                proc_status_bytes("VmSize:").unwrap_or(0),
            )
        } else {
            let avail = host_available().unwrap_or(8 << 30);
            (Source::Host, avail + rss, rss)
        };
        Self::new(
            source,
            limit,
            limit.saturating_sub(used).saturating_sub(headroom),
        )
    }

    pub fn new(source: Source, limit: u64, total: u64) -> MemoryBudget {
        MemoryBudget {
            source,
            limit,
            total,
            reserved: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Bytes reserved now.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::SeqCst)
    }

    /// The most reserved at once since start.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// One line for the start-up report.
    pub fn describe(&self) -> String {
        format!(
            "{} for requests, of {} from {}",
            mib(self.total),
            mib(self.limit),
            self.source.describe()
        )
    }

    /// Reserve `bytes` for `what` (a phrase: "to tokenize a 512 KiB prompt").
    pub fn reserve(self: &Arc<Self>, bytes: u64, what: &str) -> Result<Reservation, ApiError> {
        let mut r = Reservation {
            budget: self.clone(),
            bytes: 0,
        };
        r.grow(bytes, what)?;
        Ok(r)
    }

    fn refuse(&self, need: u64, what: &str) -> ApiError {
        if need > self.total {
            let mut e = ApiError::with_status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("request_too_large"),
                format!(
                    "this request needs up to {} of memory {what}, more than this server's budget for \
                     requests, {} (from {} of {}, less what the model uses); send a smaller request, or \
                     give the server more memory (--max-memory)",
                    mib(need),
                    mib(self.total),
                    self.source.describe(),
                    mib(self.limit)
                ),
            );
            e.param = None;
            e
        } else {
            ApiError::overloaded(
                "memory_busy",
                format!(
                    "the server's memory budget ({} from {}) is taken by other requests now; this one needs \
                     up to {} {what}; retry shortly",
                    mib(self.total),
                    self.source.describe(),
                    mib(need)
                ),
                1,
            )
        }
    }
}

impl Reservation {
    /// Take `bytes` more, or answer why not (the reservation keeps what it held).
    pub fn grow(&mut self, bytes: u64, what: &str) -> Result<(), ApiError> {
        let b = &self.budget;
        let mut cur = b.reserved.load(Ordering::SeqCst);
        loop {
            let next = cur.saturating_add(bytes);
            if next > b.total {
                return Err(b.refuse(self.bytes.saturating_add(bytes), what));
            }
            match b
                .reserved
                .compare_exchange(cur, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    b.peak.fetch_max(next, Ordering::SeqCst);
                    break;
                }
                Err(now) => cur = now,
            }
        }
        self.bytes += bytes;
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Give back all but `keep` bytes.
    pub fn shrink_to(&mut self, keep: u64) {
        if keep < self.bytes {
            self.budget
                .reserved
                .fetch_sub(self.bytes - keep, Ordering::SeqCst);
            self.bytes = keep;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3X").is_err());
    }

    #[test]
    fn parse_worst_case_counts_values() {
        assert_eq!(
            parse_worst_case(b"\"abc\""),
            5 * PARSE_BYTES_PER_BYTE + PARSE_BYTES_PER_VALUE
        );
        // a string holding separators is not split: its commas still count (an over-estimate)
        assert_eq!(
            parse_worst_case(b"[1,2]"),
            5 * PARSE_BYTES_PER_BYTE + 3 * PARSE_BYTES_PER_VALUE
        );
    }

    #[test]
    fn reservations_add_up_and_release() {
        let b = Arc::new(MemoryBudget::new(Source::Flag, 1000, 100));
        let mut r1 = b.reserve(60, "to test").unwrap();
        // Fits the budget but not beside r1: 429 that says retry.
        let e = b.reserve(50, "to test").unwrap_err();
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after, Some(1));
        // Never fits: 413 naming the budget's source.
        let e = b.reserve(101, "to test").unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(e.message.contains("--max-memory"), "{}", e.message);
        // A failed grow keeps what was held.
        assert!(r1.grow(50, "to test").is_err());
        assert_eq!(b.reserved(), 60);
        r1.grow(40, "to test").unwrap();
        assert_eq!(b.reserved(), 100);
        r1.shrink_to(10);
        assert_eq!(b.reserved(), 10);
        drop(r1);
        assert_eq!(b.reserved(), 0);
    }
}
