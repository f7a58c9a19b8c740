//! in-toto Statement v1 with a SLSA provenance v1 predicate, written by `build-target` for one target.
//!
//! - subjects: every kernel blob (`kernels/<name>.cubin`, `.ptx`, `.metal`, `.metallib`) with its
//!   sha256; the outer `attestation.json` beside the binary adds the binary itself (`metrale-server`).
//!   The statement embedded in the binary cannot name its own binary's digest (the digest would change
//!   by embedding it), so it lists the blobs only.
//! - externalParameters: the target id, the TOML texts' digests, each kernel's compile steps (flags with
//!   the toolchain folder replaced by a placeholder).
//! - internalParameters: KERNEL_SET_HASH, TARGET_CLOSURES and, per kernel, its closure manifest and hash
//!   and the function names found in its PTX (what `audit` compares against the source tree).
//! - resolvedDependencies: every closure file (template, headers, target TOML) with its sha256, the
//!   compiler libraries and the wheels they came from.
//! - runDetails.metadata: invocationId = KERNEL_SET_HASH; no timestamps in the embedded statement, so
//!   the same sources give the same bytes (the outer file adds startedOn/finishedOn).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::closure::ClosureManifest;
use crate::AttestError;

pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
pub const PREDICATE_TYPE: &str = "https://slsa.dev/provenance/v1";
pub const BUILD_TYPE: &str = "https://github.com/metrale/metrale/build-target/v1";
pub const BUILDER_ID: &str = "https://github.com/metrale/metrale/xtask/build-target";

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ResourceDescriptor {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub digest: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<serde_json::Value>,
}

impl ResourceDescriptor {
    pub fn named(name: &str, sha256: &str) -> Self {
        ResourceDescriptor {
            name: Some(name.to_string()),
            digest: [("sha256".to_string(), sha256.to_string())].into(),
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Statement {
    #[serde(rename = "_type")]
    pub type_: String,
    pub subject: Vec<ResourceDescriptor>,
    #[serde(rename = "predicateType")]
    pub predicate_type: String,
    pub predicate: Provenance,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Provenance {
    pub build_definition: BuildDefinition,
    pub run_details: RunDetails,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildDefinition {
    pub build_type: String,
    pub external_parameters: serde_json::Value,
    pub internal_parameters: InternalParameters,
    pub resolved_dependencies: Vec<ResourceDescriptor>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InternalParameters {
    pub kernel_set_hash: String,
    pub target_closures: BTreeMap<String, TargetClosure>,
    pub kernels: BTreeMap<String, KernelProvenance>,
}

/// One entry of TARGET_CLOSURES: `"hw/model/quant" -> {hash, arch, compiler, flags}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetClosure {
    /// blake3 over the sorted (kernel, closure hash) pairs of the target.
    pub hash: String,
    pub arch: String,
    pub compiler: String,
    pub flags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelProvenance {
    pub closure_hash: String,
    pub functions: Vec<String>,
    /// blob subject name -> sha256
    pub blobs: BTreeMap<String, String>,
    pub manifest: ClosureManifest,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunDetails {
    pub builder: Builder,
    pub metadata: Metadata,
    #[serde(default)]
    pub byproducts: Vec<ResourceDescriptor>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Builder {
    pub id: String,
    pub version: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Metadata {
    pub invocation_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_on: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_on: Option<String>,
}

/// What `build-target` knows about one compiled kernel.
#[derive(Debug, Clone)]
pub struct KernelRecord {
    pub name: String,
    pub manifest: ClosureManifest,
    pub functions: Vec<String>,
    /// (subject name such as "kernels/rmsnorm.cubin", bytes)
    pub blobs: Vec<(String, Vec<u8>)>,
}

/// The inputs of [`Statement::build`].
pub struct StatementInputs<'a> {
    pub target: &'a str,
    /// (repo-relative path, text) of the target's TOML files (HARDWARE.toml, shared model file, MODEL.toml).
    pub target_files: Vec<(String, String)>,
    pub kernels: &'a [KernelRecord],
    /// Compiler libraries and their origin: e.g. ("libnvrtc.so.13", sha256), ("pypi:nvidia-cuda-nvrtc==13.0.88", wheel sha256).
    pub toolchain_deps: Vec<ResourceDescriptor>,
    pub builder_version: &'a str,
}

/// KERNEL_SET_HASH: blake3 over the canonical list of (name, closure hash, blob digests), sorted by name.
pub fn kernel_set_hash(target: &str, kernels: &BTreeMap<String, KernelProvenance>) -> String {
    let list: Vec<serde_json::Value> = kernels
        .iter()
        .map(|(n, k)| serde_json::json!({"name": n, "closure_hash": k.closure_hash, "blobs": k.blobs}))
        .collect();
    let doc =
        serde_json::json!({"schema": "metrale-kernel-set-v1", "target": target, "kernels": list});
    crate::blake3_hex(crate::canonical::to_string(&doc).as_bytes())
}

impl Statement {
    /// The deterministic statement for a target's kernel set (no binary subject, no timestamps).
    pub fn build(inp: StatementInputs<'_>) -> Statement {
        let mut subject = Vec::new();
        let mut kernels = BTreeMap::new();
        let mut deps: BTreeMap<String, ResourceDescriptor> = BTreeMap::new();
        let mut steps = serde_json::Map::new();
        for k in inp.kernels {
            let mut blobs = BTreeMap::new();
            for (name, bytes) in &k.blobs {
                let d = crate::sha256_hex(bytes);
                subject.push(ResourceDescriptor::named(name, &d));
                blobs.insert(name.clone(), d);
            }
            for f in k.manifest.files() {
                let e = deps.entry(f.path.clone()).or_insert_with(|| {
                    let mut r = ResourceDescriptor::named(&f.path, &f.sha256);
                    r.annotations = Some(serde_json::json!({"kernels": []}));
                    r
                });
                if let Some(serde_json::Value::Object(a)) = e.annotations.as_mut() {
                    if let Some(serde_json::Value::Array(v)) = a.get_mut("kernels") {
                        v.push(serde_json::Value::String(k.name.clone()));
                    }
                }
            }
            steps.insert(
                k.name.clone(),
                serde_json::to_value(&k.manifest.steps).expect("steps serialize"),
            );
            kernels.insert(
                k.name.clone(),
                KernelProvenance {
                    closure_hash: k.manifest.hash(),
                    functions: k.functions.clone(),
                    blobs,
                    manifest: k.manifest.clone(),
                },
            );
        }
        subject.sort_by(|a, b| a.name.cmp(&b.name));
        let mut resolved: Vec<ResourceDescriptor> = Vec::new();
        let mut target_digests = serde_json::Map::new();
        for (path, text) in &inp.target_files {
            let d = crate::sha256_hex(text.as_bytes());
            target_digests.insert(path.clone(), serde_json::Value::String(d.clone()));
            resolved.push(ResourceDescriptor::named(path, &d));
        }
        resolved.extend(deps.into_values());
        resolved.extend(inp.toolchain_deps);

        let set_hash = kernel_set_hash(inp.target, &kernels);
        let pairs: Vec<serde_json::Value> = kernels
            .iter()
            .map(|(n, k)| serde_json::json!([n, k.closure_hash]))
            .collect();
        let first = inp.kernels.first();
        let step0 = first.and_then(|k| k.manifest.steps.first());
        let closure = TargetClosure {
            hash: crate::blake3_hex(
                crate::canonical::to_string(
                    &serde_json::json!({"target": inp.target, "kernels": pairs}),
                )
                .as_bytes(),
            ),
            arch: inp
                .kernels
                .iter()
                .flat_map(|k| k.manifest.steps.iter().map(|s| s.arch.clone()))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(","),
            compiler: first
                .map(|k| k.manifest.compiler.short())
                .unwrap_or_else(|| "none".into()),
            flags: step0.map(|s| s.flags.clone()).unwrap_or_default(),
        };
        Statement {
            type_: STATEMENT_TYPE.into(),
            subject,
            predicate_type: PREDICATE_TYPE.into(),
            predicate: Provenance {
                build_definition: BuildDefinition {
                    build_type: BUILD_TYPE.into(),
                    external_parameters: serde_json::json!({
                        "target": inp.target,
                        "target_files": target_digests,
                        "compile_steps": steps,
                    }),
                    internal_parameters: InternalParameters {
                        kernel_set_hash: set_hash.clone(),
                        target_closures: [(inp.target.to_string(), closure)].into(),
                        kernels,
                    },
                    resolved_dependencies: resolved,
                },
                run_details: RunDetails {
                    builder: Builder {
                        id: BUILDER_ID.into(),
                        version: [("metrale".to_string(), inp.builder_version.to_string())].into(),
                    },
                    metadata: Metadata {
                        invocation_id: set_hash,
                        started_on: None,
                        finished_on: None,
                    },
                    byproducts: Vec::new(),
                },
            },
        }
    }

    pub fn from_json(s: &str) -> Result<Statement, AttestError> {
        let st: Statement = serde_json::from_str(s)?;
        if st.type_ != STATEMENT_TYPE {
            return Err(AttestError::Invalid {
                field: "_type".into(),
                expected: STATEMENT_TYPE.into(),
                got: st.type_,
            });
        }
        if st.predicate_type != PREDICATE_TYPE {
            return Err(AttestError::Invalid {
                field: "predicateType".into(),
                expected: PREDICATE_TYPE.into(),
                got: st.predicate_type,
            });
        }
        Ok(st)
    }

    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("a statement is always JSON-serializable")
    }

    /// The sha256 recorded for subject `name`.
    pub fn subject_sha256(&self, name: &str) -> Option<&str> {
        self.subject
            .iter()
            .find(|s| s.name.as_deref() == Some(name))
            .and_then(|s| s.digest.get("sha256"))
            .map(|s| s.as_str())
    }

    pub fn kernel_set_hash(&self) -> &str {
        &self
            .predicate
            .build_definition
            .internal_parameters
            .kernel_set_hash
    }

    /// The statement with one more subject (the binary) and timestamps: the outer `attestation.json`.
    pub fn with_binary(
        &self,
        name: &str,
        sha256: &str,
        started_on: Option<String>,
        finished_on: Option<String>,
    ) -> Statement {
        let mut s = self.clone();
        s.subject.push(ResourceDescriptor::named(name, sha256));
        s.predicate.run_details.metadata.started_on = started_on;
        s.predicate.run_details.metadata.finished_on = finished_on;
        s
    }
}
