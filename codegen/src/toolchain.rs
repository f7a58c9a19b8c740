//! The pinned NVRTC toolchain: its lock file (`codegen/toolchain.lock.toml`, compiled in), where it is
//! installed, its identity, and loading it.
//!
//! Location: env `METRALE_TOOLCHAIN` if set, else `<repo>/.toolchain/cuda-13.0`. Layout:
//! `lib/libnvrtc.so.13`, `lib/libnvrtc-builtins.so.13.0`, `include/` (CUDA headers), `INSTALLED.toml`
//! (written last by `cargo xtask toolchain` after every digest checked out).
//!
//! Loading is hermetic: both libraries are dlopened by absolute path, builtins first. libnvrtc later
//! dlopens `libnvrtc-builtins.so.13.0` by name, and the dynamic loader answers with the already
//! loaded library whose soname matches, so no LD_LIBRARY_PATH is needed and no system NVRTC can be
//! picked up instead of the attested one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use metrale_attestation::closure::CompilerId;
use metrale_attestation::statement::ResourceDescriptor;
use serde::Deserialize;

use crate::CodegenError;

/// The lock file's text, compiled in.
pub const LOCK_TOML: &str = include_str!("../toolchain.lock.toml");

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    pub version: String,
    pub dir: String,
    pub platforms: Vec<String>,
    pub wheel: Vec<LockedWheel>,
    pub libs: BTreeMap<String, String>,
    pub headers: LockedHeaders,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockedWheel {
    pub package: String,
    pub version: String,
    pub file: String,
    pub sha256: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockedHeaders {
    pub sha256: String,
}

impl Lock {
    pub fn get() -> Lock {
        toml::from_str(LOCK_TOML)
            .expect("codegen/toolchain.lock.toml is valid (checked by a unit test)")
    }

    /// The compiler identity recorded in closures and attestations.
    pub fn compiler_id(&self) -> CompilerId {
        CompilerId {
            name: "nvrtc".into(),
            version: self.version.clone(),
            libs: self.libs.clone(),
            headers_sha256: self.headers.sha256.clone(),
        }
    }

    /// resolvedDependencies entries for the compiler: the libraries and the wheels they came from.
    pub fn dependencies(&self) -> Vec<ResourceDescriptor> {
        let mut v: Vec<ResourceDescriptor> = self
            .libs
            .iter()
            .map(|(n, d)| ResourceDescriptor::named(&format!("toolchain/lib/{n}"), d))
            .collect();
        v.push(ResourceDescriptor::named(
            "toolchain/include",
            &self.headers.sha256,
        ));
        for w in &self.wheel {
            let mut r = ResourceDescriptor::named(&w.file, &w.sha256);
            r.uri = Some(format!("pkg:pypi/{}@{}", w.package, w.version));
            v.push(r);
        }
        v
    }
}

/// Where the toolchain lives for a repository (env METRALE_TOOLCHAIN wins).
pub fn default_dir(repo_root: &Path) -> PathBuf {
    match std::env::var_os("METRALE_TOOLCHAIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo_root.join(".toolchain").join(Lock::get().dir),
    }
}

/// sha256 over "<relative path>\t<sha256>\n" lines of every file under `include`, sorted by path.
pub fn headers_digest(include: &Path) -> Result<String, CodegenError> {
    let mut files = Vec::new();
    walk(include, include, &mut files)?;
    files.sort();
    let mut listing = String::new();
    for rel in files {
        let p = include.join(&rel);
        let bytes = std::fs::read(&p).map_err(|source| CodegenError::Io {
            path: p.clone(),
            source,
        })?;
        listing.push_str(&format!(
            "{rel}\t{}\n",
            metrale_attestation::sha256_hex(&bytes)
        ));
    }
    Ok(metrale_attestation::sha256_hex(listing.as_bytes()))
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), CodegenError> {
    let rd = std::fs::read_dir(dir).map_err(|source| CodegenError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for e in rd {
        let e = e.map_err(|source| CodegenError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let p = e.path();
        if p.is_dir() {
            walk(root, &p, out)?;
        } else {
            let rel = p
                .strip_prefix(root)
                .expect("under root")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push(rel);
        }
    }
    Ok(())
}

/// An installed toolchain (checked for presence; digests were checked at install time).
#[derive(Debug, Clone)]
pub struct Toolchain {
    pub dir: PathBuf,
    pub lock: Lock,
}

/// Marker written by `cargo xtask toolchain` once every digest matched.
pub const INSTALLED: &str = "INSTALLED.toml";

impl Toolchain {
    /// Finds the installed toolchain, or says which command installs it.
    pub fn locate(dir: &Path) -> Result<Toolchain, CodegenError> {
        let lock = Lock::get();
        let missing = |detail: String| CodegenError::Toolchain {
            dir: dir.to_path_buf(),
            detail,
        };
        let marker = dir.join(INSTALLED);
        let text = std::fs::read_to_string(&marker)
            .map_err(|_| missing(format!("{} is missing", marker.display())))?;
        let installed: toml::Table = text
            .parse()
            .map_err(|e| missing(format!("{}: {e}", marker.display())))?;
        let v = installed
            .get("version")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if v != lock.version {
            return Err(missing(format!(
                "installed version {v:?}, the lock file pins {:?}",
                lock.version
            )));
        }
        for lib in lock.libs.keys() {
            let p = dir.join("lib").join(lib);
            if !p.is_file() {
                return Err(missing(format!("{} is missing", p.display())));
            }
        }
        if !dir.join("include").join("cuda_fp16.h").is_file() {
            return Err(missing(format!(
                "{} is missing",
                dir.join("include/cuda_fp16.h").display()
            )));
        }
        Ok(Toolchain {
            dir: dir.to_path_buf(),
            lock,
        })
    }

    pub fn include_dir(&self) -> PathBuf {
        self.dir.join("include")
    }
    pub fn lib_dir(&self) -> PathBuf {
        self.dir.join("lib")
    }
    pub fn compiler_id(&self) -> CompilerId {
        self.lock.compiler_id()
    }
    /// Re-hashes the installed libraries and headers against the lock file (slow: ~110 MB).
    pub fn verify(&self) -> Result<(), CodegenError> {
        for (lib, want) in &self.lock.libs {
            let p = self.lib_dir().join(lib);
            let bytes = std::fs::read(&p).map_err(|source| CodegenError::Io {
                path: p.clone(),
                source,
            })?;
            let got = metrale_attestation::sha256_hex(&bytes);
            if &got != want {
                return Err(CodegenError::Toolchain {
                    dir: self.dir.clone(),
                    detail: format!(
                        "{} has sha256 {got}, the lock file says {want}",
                        p.display()
                    ),
                });
            }
        }
        let got = headers_digest(&self.include_dir())?;
        if got != self.lock.headers.sha256 {
            return Err(CodegenError::Toolchain {
                dir: self.dir.clone(),
                detail: format!(
                    "headers digest {got}, the lock file says {}",
                    self.lock.headers.sha256
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lock_parses() {
        let l = super::Lock::get();
        assert_eq!(l.wheel.len(), 2);
        assert!(l.libs.contains_key("libnvrtc.so.13"));
        assert_eq!(l.headers.sha256.len(), 64);
    }
}
