//! metrale-kernels: the compiled-kernel registry of this binary.
//!
//! `cargo xtask build-target` writes a kernel pack (format: `metrale_attestation::pack`) holding the
//! target's TOML texts, the attestation statement, TARGET_CLOSURES, KERNEL_SET_HASH and every kernel's
//! function names and blobs (cubin + PTX, or Metal source + metallib), and builds the server with env
//! METRALE_KERNEL_PACK naming it. build.rs copies the pack into OUT_DIR and this crate embeds it as a
//! static in the ELF section `.metrale` (see `metrale_attestation::pack::SECTION`), so
//! `cargo xtask audit` can read the very bytes the binary will use without running it.
//!
//! Without METRALE_KERNEL_PACK the pack is empty: [`registry`] has no target and no kernels (a
//! generic CPU build). The pack is parsed lazily on first use.
//!
//! Invariants: blobs are `&'static` slices of the embedded static, never copies; [`Registry::verify`]
//! compares each blob's sha256 with the digest the embedded statement attests, and the CUDA backend
//! must call it before loading anything; a corrupt pack never panics: it becomes a registry whose
//! `verify` fails with the parse error.

use std::sync::OnceLock;

use metrale_attestation::pack::{keys, Pack};
use metrale_attestation::statement::Statement;
use metrale_core::target::{TargetId, TargetSpec};

include!(concat!(env!("OUT_DIR"), "/pack_len.rs"));

#[cfg_attr(target_os = "linux", link_section = ".metrale")]
#[used]
static PACK: [u8; PACK_LEN] = *include_bytes!(concat!(env!("OUT_DIR"), "/pack.bin"));

/// The embedded pack's bytes, read through an opaque pointer so the compiler cannot fold them: what
/// is checked at run time is what is in the file.
pub fn pack_bytes() -> &'static [u8] {
    let p = std::hint::black_box(PACK.as_ptr());
    // SAFETY: p points at the static PACK of PACK_LEN bytes, alive for the whole program.
    unsafe { std::slice::from_raw_parts(p, PACK_LEN) }
}

/// Error of the registry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelsError {
    #[error("the embedded kernel pack is corrupt: {0}. Rebuild the binary with `cargo xtask build-target`.")]
    Corrupt(String),
    #[error("kernel `{kernel}`: blob {blob} has sha256 {actual}, the embedded attestation says {attested}: the binary was modified after it was built; rebuild it")]
    DigestMismatch {
        kernel: String,
        blob: String,
        attested: String,
        actual: String,
    },
    #[error("kernel `{kernel}`: blob {blob} is not attested by the embedded statement")]
    NotAttested { kernel: String, blob: String },
    #[error("KERNEL_SET_HASH mismatch: embedded {embedded}, recomputed from the attestation {recomputed}")]
    KernelSetHash {
        embedded: String,
        recomputed: String,
    },
}

/// One compiled kernel of this binary.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// Template name, e.g. "rmsnorm".
    pub name: String,
    /// Kernel function names (`.entry` lines of the PTX, or `kernel void` of a Metal source).
    pub functions: Vec<String>,
    /// cubin for the target's exact arch (empty for non-CUDA targets).
    pub cubin: &'static [u8],
    /// PTX for the target's virtual arch (empty for non-CUDA targets).
    pub ptx: &'static str,
    /// Metal: the rendered source and, where it was built, the metallib.
    pub metal: &'static str,
    pub metallib: &'static [u8],
}

/// What this binary was built for and with.
#[derive(Debug)]
pub struct Registry {
    /// None for a generic build (no pack) or a corrupt pack.
    pub target: Option<TargetSpec>,
    pub kernels: Vec<Kernel>,
    /// Empty for a generic build.
    pub kernel_set_hash: String,
    /// The embedded in-toto statement (empty string for a generic build).
    pub attestation_json: &'static str,
    /// TARGET_CLOSURES as JSON (empty string for a generic build).
    pub target_closures_json: &'static str,
    /// (target id, model_type, hidden_size) of every target known when this binary was built.
    pub matrix: Vec<(String, String, usize)>,
    statement: Option<Statement>,
    error: Option<KernelsError>,
}

impl Registry {
    fn empty(error: Option<KernelsError>) -> Registry {
        Registry {
            target: None,
            kernels: Vec::new(),
            kernel_set_hash: String::new(),
            attestation_json: "",
            target_closures_json: "",
            matrix: Vec::new(),
            statement: None,
            error,
        }
    }

    /// Parses a pack (the embedded one, or any other for tests and tools).
    pub fn from_pack(bytes: &'static [u8]) -> Registry {
        if bytes.is_empty() {
            return Registry::empty(None);
        }
        match Self::parse(bytes) {
            Ok(r) => r,
            Err(e) => Registry::empty(Some(e)),
        }
    }

    fn parse(bytes: &'static [u8]) -> Result<Registry, KernelsError> {
        let c = |e: metrale_attestation::AttestError| KernelsError::Corrupt(e.to_string());
        let pack = Pack::parse(bytes).map_err(c)?;
        let s = |k: &str| -> Result<&'static str, KernelsError> {
            pack.get_str(k)
                .map_err(c)?
                .ok_or_else(|| KernelsError::Corrupt(format!("entry {k} missing")))
        };
        let id: TargetId = s(keys::TARGET_ID)?
            .parse()
            .map_err(|e: metrale_core::target::TargetError| KernelsError::Corrupt(e.to_string()))?;
        let spec = TargetSpec::from_toml(s(keys::HARDWARE_TOML)?, s(keys::MODEL_TOML)?, &id)
            .map_err(|e| KernelsError::Corrupt(e.to_string()))?;
        let attestation_json = s(keys::ATTESTATION)?;
        let statement = Statement::from_json(attestation_json).map_err(c)?;
        let mut kernels = Vec::new();
        for name in pack.kernel_names().map_err(c)? {
            let blob = |kind: &str| pack.get(&keys::kernel(name, kind)).unwrap_or(&[]);
            let text = |kind: &str| {
                pack.get_str(&keys::kernel(name, kind))
                    .map(|o| o.unwrap_or(""))
                    .map_err(c)
            };
            kernels.push(Kernel {
                name: name.to_string(),
                functions: text("functions")?
                    .lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_string)
                    .collect(),
                cubin: blob("cubin"),
                ptx: text("ptx")?,
                metal: text("metal")?,
                metallib: blob("metallib"),
            });
        }
        let matrix = pack
            .get_str(keys::MATRIX)
            .map_err(c)?
            .unwrap_or("")
            .lines()
            .filter_map(|l| {
                let mut f = l.split('\t');
                Some((
                    f.next()?.to_string(),
                    f.next()?.to_string(),
                    f.next()?.parse().ok()?,
                ))
            })
            .collect();
        Ok(Registry {
            matrix,
            target: Some(spec),
            kernels,
            kernel_set_hash: s(keys::KERNEL_SET_HASH)?.to_string(),
            attestation_json,
            target_closures_json: s(keys::TARGET_CLOSURES)?,
            statement: Some(statement),
            error: None,
        })
    }

    /// Targets (of the matrix known at build time) that serve a checkpoint with this config, e.g. to
    /// name them when refusing it. Empty for a generic build.
    pub fn targets_serving(&self, model_type: &str, hidden_size: usize) -> Vec<String> {
        self.matrix
            .iter()
            .filter(|(_, m, h)| m == model_type && *h == hidden_size)
            .map(|(t, _, _)| t.clone())
            .collect()
    }

    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.name == name)
    }

    /// Checks every embedded blob against the sha256 the embedded statement attests, and the
    /// KERNEL_SET_HASH against the statement. Ok for a generic (pack-less) build.
    pub fn verify(&self) -> Result<(), KernelsError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let Some(st) = &self.statement else {
            return Ok(());
        };
        for k in &self.kernels {
            let blobs: [(&str, &[u8]); 4] = [
                ("cubin", k.cubin),
                ("ptx", k.ptx.as_bytes()),
                ("metal", k.metal.as_bytes()),
                ("metallib", k.metallib),
            ];
            for (kind, bytes) in blobs {
                let subject = format!("kernels/{}.{kind}", k.name);
                match st.subject_sha256(&subject) {
                    Some(att) => {
                        let actual = metrale_attestation::sha256_hex(bytes);
                        if actual != att {
                            return Err(KernelsError::DigestMismatch {
                                kernel: k.name.clone(),
                                blob: subject,
                                attested: att.to_string(),
                                actual,
                            });
                        }
                    }
                    None if !bytes.is_empty() => {
                        return Err(KernelsError::NotAttested {
                            kernel: k.name.clone(),
                            blob: subject,
                        })
                    }
                    None => {}
                }
            }
        }
        for k in st
            .predicate
            .build_definition
            .internal_parameters
            .kernels
            .keys()
        {
            if self.kernel(k).is_none() {
                return Err(KernelsError::Corrupt(format!(
                    "kernel `{k}` is attested but missing from the pack"
                )));
            }
        }
        let recomputed = metrale_attestation::statement::kernel_set_hash(
            &self
                .target
                .as_ref()
                .map(|t| t.id.to_string())
                .unwrap_or_default(),
            &st.predicate.build_definition.internal_parameters.kernels,
        );
        if recomputed != self.kernel_set_hash || recomputed != st.kernel_set_hash() {
            return Err(KernelsError::KernelSetHash {
                embedded: self.kernel_set_hash.clone(),
                recomputed,
            });
        }
        Ok(())
    }

    /// Human-readable description for `metrale-server --target-info`.
    pub fn target_info(&self) -> String {
        match (&self.target, &self.error) {
            (_, Some(e)) => format!("error: {e}\n"),
            (None, None) => "target: none embedded (a generic build without `cargo xtask build-target`: CPU backend, no compiled kernels)\n".to_string(),
            (Some(t), None) => {
                let mut s = t.describe();
                s.push_str(&format!("KERNEL_SET_HASH: {}\n", self.kernel_set_hash));
                if let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(self.target_closures_json) {
                    for (id, v) in m {
                        s.push_str(&format!(
                            "TARGET_CLOSURES[{id}]: hash {} arch {} compiler {}\n",
                            v["hash"].as_str().unwrap_or("?"),
                            v["arch"].as_str().unwrap_or("?"),
                            v["compiler"].as_str().unwrap_or("?")
                        ));
                    }
                }
                for k in &self.kernels {
                    s.push_str(&format!("kernel {}: functions [{}], cubin {} B, ptx {} B\n", k.name, k.functions.join(", "), k.cubin.len(), k.ptx.len()));
                }
                s
            }
        }
    }
}

/// The registry of this binary (parsed on first use).
pub fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| Registry::from_pack(pack_bytes()))
}

/// The embedded attestation statement (in-toto v1 JSON); empty for a generic build.
pub fn attestation_json() -> &'static str {
    registry().attestation_json
}

/// What `metrale-server --target-info` prints.
pub fn target_info() -> String {
    registry().target_info()
}

#[cfg(test)]
mod tests {
    #[test]
    fn generic_build_is_empty_and_verifies() {
        let r = super::registry();
        if super::PACK_LEN == 0 {
            assert!(r.target.is_none());
            assert!(r.kernels.is_empty());
            assert!(r.verify().is_ok());
            assert!(super::target_info().contains("generic build"));
        }
    }
}
