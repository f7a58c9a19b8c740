//! The closure of one kernel: everything that can change its compiled bytes, as a manifest of
//! repo-relative paths and digests, and the manifest's hash.
//!
//! `closure_hash = blake3("metrale-closure-v1\n" || canonical_json(manifest))`. The manifest holds the
//! template's path and sha256, the rendered source's sha256, each header's repo-relative path and sha256
//! (sorted by path), the handlebars parameters, the compiler identity (name, version, digests of its
//! libraries and of its system headers) and each compile step's output kind, arch and exact flag
//! vector. Flags that name the toolchain's folder carry the placeholder [`TOOLCHAIN_PLACEHOLDER`]
//! instead of the absolute path, so the hash is the same in every clone and on every machine.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Stands for the toolchain's absolute folder in flags that enter hashes and attestations.
pub const TOOLCHAIN_PLACEHOLDER: &str = "${METRALE_TOOLCHAIN}";
/// Version tag of the manifest schema and of how a closure is compiled (part of the hash), so that
/// no cache entry compiled another way is reused: v2 ran NVRTC in its own thread of the worker
/// process (blobs independent of the worker executable); v3 also runs it from `/`, reaching the
/// toolchain through `/proc/self/fd` (blobs independent of where the clone and toolchain live;
/// `metrale_codegen::worker`).
pub const SCHEMA: &str = "metrale-closure-v3";

/// A file in a closure: repo-relative path (always `/`-separated) and sha256.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FileDigest {
    pub path: String,
    pub sha256: String,
}

/// The identity of a compiler: what produced the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompilerId {
    /// "nvrtc" | "xcrun-metal" | ...
    pub name: String,
    pub version: String,
    /// library file name -> sha256
    pub libs: BTreeMap<String, String>,
    /// sha256 over the sorted (path, sha256) list of the system headers the compiler is given.
    pub headers_sha256: String,
}

impl CompilerId {
    /// One line for humans: "nvrtc 13.0.88 (libnvrtc.so.13 sha256:ab12..)".
    pub fn short(&self) -> String {
        let libs: Vec<String> = self
            .libs
            .iter()
            .map(|(k, v)| format!("{k} sha256:{}", &v[..v.len().min(12)]))
            .collect();
        format!("{} {} ({})", self.name, self.version, libs.join(", "))
    }
}

/// One compiler invocation of a kernel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompileStep {
    /// "cubin" | "ptx" | "metallib"
    pub output: String,
    pub arch: String,
    /// The exact option vector, toolchain paths replaced by [`TOOLCHAIN_PLACEHOLDER`].
    pub flags: Vec<String>,
}

/// Everything a kernel's compiled bytes depend on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClosureManifest {
    pub schema: String,
    pub kernel: String,
    pub backend: String,
    pub target: String,
    pub template: FileDigest,
    pub rendered_sha256: String,
    /// Sorted by path.
    pub headers: Vec<FileDigest>,
    /// The handlebars context the template was rendered with.
    pub params: serde_json::Value,
    pub compiler: CompilerId,
    pub steps: Vec<CompileStep>,
}

impl ClosureManifest {
    /// The closure hash (hex blake3).
    pub fn hash(&self) -> String {
        let mut h = blake3::Hasher::new();
        h.update(SCHEMA.as_bytes());
        h.update(b"\n");
        h.update(
            crate::canonical::encode(self)
                .expect("a manifest is always JSON-serializable")
                .as_bytes(),
        );
        h.finalize().to_hex().to_string()
    }

    /// Every source file of the closure (template first, then headers).
    pub fn files(&self) -> impl Iterator<Item = &FileDigest> {
        std::iter::once(&self.template).chain(self.headers.iter())
    }

    /// What differs between `self` (recorded) and `now` (recomputed), in words, e.g.
    /// `["kernels/cuda/common.cuh changed", "compiler changed"]`. Empty when the hashes agree.
    pub fn diff(&self, now: &ClosureManifest) -> Vec<String> {
        let mut out = Vec::new();
        let old: BTreeMap<&str, &str> = self
            .files()
            .map(|f| (f.path.as_str(), f.sha256.as_str()))
            .collect();
        let new: BTreeMap<&str, &str> = now
            .files()
            .map(|f| (f.path.as_str(), f.sha256.as_str()))
            .collect();
        for (p, d) in &old {
            match new.get(p) {
                None => out.push(format!(
                    "{p} no longer in the closure (removed or no longer included)"
                )),
                Some(n) if n != d => out.push(format!("{p} changed")),
                _ => {}
            }
        }
        for p in new.keys() {
            if !old.contains_key(p) {
                out.push(format!("{p} newly included"));
            }
        }
        if self.params != now.params {
            let mut keys = Vec::new();
            diff_values("", &self.params, &now.params, &mut keys);
            out.push(format!("target parameters changed: {}", keys.join(", ")));
        }
        if self.compiler != now.compiler {
            out.push(format!(
                "compiler changed: {} -> {}",
                self.compiler.short(),
                now.compiler.short()
            ));
        }
        if self.steps != now.steps {
            out.push("compile flags or archs changed".to_string());
        }
        if self.rendered_sha256 != now.rendered_sha256 && out.is_empty() {
            out.push("rendered source changed".to_string());
        }
        if out.is_empty() && self.hash() != now.hash() {
            out.push("closure schema or kernel identity changed".to_string());
        }
        out
    }
}

fn diff_values(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => diff_values(&p, u, v, out),
                    _ => out.push(p),
                }
            }
        }
        (x, y) if x != y => out.push(prefix.to_string()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn m() -> ClosureManifest {
        ClosureManifest {
            schema: SCHEMA.into(),
            kernel: "k".into(),
            backend: "cuda".into(),
            target: "h200/m/q".into(),
            template: FileDigest {
                path: "kernels/cuda/k.cu.hbs".into(),
                sha256: "aa".into(),
            },
            rendered_sha256: "bb".into(),
            headers: vec![FileDigest {
                path: "kernels/cuda/a.cuh".into(),
                sha256: "cc".into(),
            }],
            params: serde_json::json!({"model": {"hidden": 576}}),
            compiler: CompilerId {
                name: "nvrtc".into(),
                version: "13.0.88".into(),
                libs: BTreeMap::new(),
                headers_sha256: "dd".into(),
            },
            steps: vec![],
        }
    }
    #[test]
    fn diff_names_the_changed_header_and_param() {
        let a = m();
        let mut b = m();
        b.headers[0].sha256 = "ee".into();
        b.params = serde_json::json!({"model": {"hidden": 577}});
        assert_ne!(a.hash(), b.hash());
        let d = a.diff(&b);
        assert_eq!(
            d,
            vec![
                "kernels/cuda/a.cuh changed".to_string(),
                "target parameters changed: model.hidden".to_string()
            ]
        );
        assert!(a.diff(&a.clone()).is_empty());
    }
}
