//! The kernel pack: the single blob `build-target` writes for a target and the server binary embeds in
//! its ELF section `.metrale` (so `cargo xtask audit` reads it from the file without running it, and
//! the binary reads the same bytes at run time).
//!
//! Layout (all integers little-endian):
//! ```text
//! magic    8 bytes  "MTRLPACK"
//! version  u32      1
//! total    u64      length of the whole pack in bytes (a section may be padded after it)
//! count    u32      number of entries
//! entries  count x { key_len u32, key (UTF-8), val_len u64, value }
//! ```
//! Keys (see [`keys`]): `target/id`, `target/HARDWARE.toml`, `target/MODEL.toml` (resolved),
//! `attestation.json` (the embedded in-toto statement), `TARGET_CLOSURES` (JSON), `KERNEL_SET_HASH`,
//! `kernels` (kernel names in declaration order, one per line), `targets/matrix` and per kernel
//! `kernel/<name>/{functions,cubin,ptx,metal,metallib}` (functions: one name per line).
//! Keys are unique and sorted in the file, so the same inputs give the same bytes.
//! Parsing is bounds-checked: a truncated or corrupt pack is an error naming the byte offset.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::AttestError;

pub const MAGIC: &[u8; 8] = b"MTRLPACK";
pub const VERSION: u32 = 1;
/// The ELF section the server binary keeps its pack in.
pub const SECTION: &str = ".metrale";
const HEADER: usize = 8 + 4 + 8 + 4;

pub mod keys {
    pub const TARGET_ID: &str = "target/id";
    pub const HARDWARE_TOML: &str = "target/HARDWARE.toml";
    pub const MODEL_TOML: &str = "target/MODEL.toml";
    pub const ATTESTATION: &str = "attestation.json";
    pub const TARGET_CLOSURES: &str = "TARGET_CLOSURES";
    pub const KERNEL_SET_HASH: &str = "KERNEL_SET_HASH";
    pub const KERNELS: &str = "kernels";
    /// The whole target matrix at build time, one `hw/model/quant\tmodel_type\thidden_size` line per
    /// served pair (informational: lets a binary name the targets that would serve a checkpoint).
    pub const MATRIX: &str = "targets/matrix";
    /// `kernel/<name>/<kind>`, kind one of functions, cubin, ptx, metal, metallib.
    pub fn kernel(name: &str, kind: &str) -> String {
        format!("kernel/{name}/{kind}")
    }
}

/// Builds a pack.
#[derive(Debug, Default, Clone)]
pub struct PackWriter {
    entries: BTreeMap<String, Vec<u8>>,
}

impl PackWriter {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn add(&mut self, key: impl Into<String>, value: impl Into<Vec<u8>>) -> &mut Self {
        self.entries.insert(key.into(), value.into());
        self
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        let body: usize = self
            .entries
            .iter()
            .map(|(k, v)| 4 + k.len() + 8 + v.len())
            .sum();
        let total = HEADER + body;
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(total as u64).to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (k, v) in &self.entries {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            out.extend_from_slice(v);
        }
        debug_assert_eq!(out.len(), total);
        out
    }
}

/// A parsed pack borrowing its bytes.
#[derive(Debug, Clone)]
pub struct Pack<'a> {
    bytes: &'a [u8],
    entries: BTreeMap<&'a str, Range<usize>>,
}

fn err(what: &'static str, offset: usize, detail: impl Into<String>) -> AttestError {
    AttestError::Pack {
        what,
        offset,
        detail: detail.into(),
    }
}

impl<'a> Pack<'a> {
    /// Parses a pack at the start of `bytes` (trailing bytes after `total` are ignored).
    pub fn parse(bytes: &'a [u8]) -> Result<Pack<'a>, AttestError> {
        if bytes.len() < HEADER {
            return Err(err(
                "header",
                0,
                format!("{} bytes, need at least {HEADER}", bytes.len()),
            ));
        }
        if &bytes[..8] != MAGIC {
            return Err(err(
                "magic",
                0,
                format!("expected {:?}, got {:?}", MAGIC, &bytes[..8]),
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(err(
                "version",
                8,
                format!("expected {VERSION}, got {version}"),
            ));
        }
        let total = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
        if total > bytes.len() as u64 || total < HEADER as u64 {
            return Err(err(
                "total length",
                12,
                format!("{total} but {} bytes available", bytes.len()),
            ));
        }
        let bytes = &bytes[..total as usize];
        let count = u32::from_le_bytes(bytes[20..24].try_into().unwrap()) as usize;
        if count > (bytes.len() - HEADER) / 12 {
            return Err(err(
                "entry count",
                20,
                format!("{count} entries cannot fit in {} bytes", bytes.len()),
            ));
        }
        let mut entries = BTreeMap::new();
        let mut pos = HEADER;
        for _ in 0..count {
            let take =
                |pos: usize, n: usize, what: &'static str| -> Result<Range<usize>, AttestError> {
                    let end = pos
                        .checked_add(n)
                        .filter(|e| *e <= bytes.len())
                        .ok_or_else(|| {
                            err(
                                what,
                                pos,
                                format!("{n} bytes past the end ({})", bytes.len()),
                            )
                        })?;
                    Ok(pos..end)
                };
            let r = take(pos, 4, "key length")?;
            let klen = u32::from_le_bytes(bytes[r.clone()].try_into().unwrap()) as usize;
            let kr = take(r.end, klen, "key")?;
            let key = std::str::from_utf8(&bytes[kr.clone()])
                .map_err(|e| err("key", kr.start, e.to_string()))?;
            let r = take(kr.end, 8, "value length")?;
            let vlen = u64::from_le_bytes(bytes[r.clone()].try_into().unwrap());
            let vlen = usize::try_from(vlen)
                .map_err(|_| err("value length", r.start, vlen.to_string()))?;
            let vr = take(r.end, vlen, "value")?;
            pos = vr.end;
            if entries.insert(key, vr).is_some() {
                return Err(err("key", kr.start, format!("duplicate key {key}")));
            }
        }
        if pos != bytes.len() {
            return Err(err(
                "trailing bytes",
                pos,
                format!("{} bytes after the last entry", bytes.len() - pos),
            ));
        }
        Ok(Pack { bytes, entries })
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn get(&self, key: &str) -> Option<&'a [u8]> {
        self.entries.get(key).map(|r| &self.bytes[r.clone()])
    }
    pub fn get_str(&self, key: &str) -> Result<Option<&'a str>, AttestError> {
        match self.entries.get(key) {
            None => Ok(None),
            Some(r) => std::str::from_utf8(&self.bytes[r.clone()])
                .map(Some)
                .map_err(|e| err("UTF-8 value", r.start, format!("{key}: {e}"))),
        }
    }
    /// Byte range of `key`'s value within the pack.
    pub fn range(&self, key: &str) -> Option<Range<usize>> {
        self.entries.get(key).cloned()
    }
    pub fn keys(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.entries.keys().copied()
    }
    /// Kernel names in declaration order (the `kernels` entry).
    pub fn kernel_names(&self) -> Result<Vec<&'a str>, AttestError> {
        Ok(self
            .get_str(keys::KERNELS)?
            .map(|s| s.lines().filter(|l| !l.is_empty()).collect())
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn roundtrip_and_corruption() {
        let mut w = PackWriter::new();
        w.add("b", b"hello".to_vec())
            .add("a", Vec::<u8>::new())
            .add(keys::KERNELS, b"x\ny\n".to_vec());
        let mut bytes = w.to_bytes();
        let p = Pack::parse(&bytes).unwrap();
        assert_eq!(p.get("b"), Some(&b"hello"[..]));
        assert_eq!(p.get("a"), Some(&b""[..]));
        assert_eq!(p.kernel_names().unwrap(), vec!["x", "y"]);
        bytes.extend_from_slice(&[0, 0, 0]); // section padding is fine
        assert!(Pack::parse(&bytes).is_ok());
        for cut in 0..bytes.len() - 3 {
            assert!(Pack::parse(&bytes[..cut]).is_err(), "truncated at {cut}");
        }
        let mut bad = bytes.clone();
        bad[20] = 0xff; // absurd count
        assert!(Pack::parse(&bad).is_err());
    }
}
