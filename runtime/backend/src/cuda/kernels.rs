//! The compiled kernels of one target: the blobs (from this binary's embedded pack, or from a
//! `build-target` output folder) and, once loaded onto a [`Device`], their entry points indexed by
//! `metrale_abi::Entry`.
//!
//! Invariants: the templates loaded are the target's `kernels` list, which holds every template of the
//! ABI (`metrale_abi::templates`) but the optional ones its family does not ask for
//! (`metrale_core::target::FEATURE_TEMPLATES`, validated with the target); their entry points are exactly
//! those the ABI declares (`metrale_abi::ENTRIES`), and an absent template's entries are never
//! launched ([`Kernels::has`]); a module is loaded from its cubin, or from its PTX when the driver
//! refuses the cubin; where a module's PTX is present, its entry points are checked against the ABI
//! again before any launch (`metrale_abi::check_ptx`, as `build-target` did); a device whose compute
//! capability differs from the cubins' arch is refused before any module is loaded.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};
use metrale_abi::ENTRIES;
use metrale_core::target::{TargetSpec, FEATURE_TEMPLATES};
use metrale_core::BackendError;

use super::device::{dev_err, Device};
use super::plan;

/// One compiled kernel: cubin for the exact arch, PTX as fallback.
#[derive(Debug, Clone)]
pub struct KernelBlob {
    pub name: String,
    pub cubin: Vec<u8>,
    pub ptx: Option<Vec<u8>>,
}

/// The compiled kernels of one target, with the target they were built for.
#[derive(Debug, Clone)]
pub struct KernelSet {
    pub spec: TargetSpec,
    /// "hw/model/quant"
    pub target: String,
    /// Cubin arch, e.g. "sm_90a".
    pub arch: String,
    pub blobs: BTreeMap<String, KernelBlob>,
}

fn cuda_arch(spec: &TargetSpec) -> Result<(String, String), BackendError> {
    let target = spec.id.to_string();
    let arch = spec.hardware.cubin_arch.clone().ok_or_else(|| {
        BackendError::Device(format!(
            "target {target} is not a CUDA target (no cubin arch)"
        ))
    })?;
    Ok((target, arch))
}

impl KernelSet {
    /// Read `<dir>/<template>.cubin` (and `<template>.ptx` when present) for every template of the
    /// ABI: the `kernels/` folder `cargo xtask build-target` writes for `spec`.
    pub fn from_dir(dir: &Path, spec: &TargetSpec) -> Result<KernelSet, BackendError> {
        let (target, arch) = cuda_arch(spec)?;
        let mut blobs = BTreeMap::new();
        for name in templates_of(spec) {
            let cp = dir.join(format!("{name}.cubin"));
            let cubin = std::fs::read(&cp).map_err(|e| {
                BackendError::Device(format!(
                    "kernel {name}: cannot read {}: {e}; build the target's kernels first (cargo xtask build-target --hw {} --model {} --quant {} --kernels-only)",
                    cp.display(), spec.id.hw, spec.id.model, spec.id.quant
                ))
            })?;
            let ptx = std::fs::read(dir.join(format!("{name}.ptx"))).ok();
            blobs.insert(
                name.to_string(),
                KernelBlob {
                    name: name.to_string(),
                    cubin,
                    ptx,
                },
            );
        }
        Ok(KernelSet {
            spec: spec.clone(),
            target,
            arch,
            blobs,
        })
    }

    /// The kernels embedded in this binary (`metrale_kernels::registry()`), after checking every
    /// blob's sha256 against the embedded attestation.
    pub fn from_registry(reg: &metrale_kernels::Registry) -> Result<KernelSet, BackendError> {
        reg.verify()
            .map_err(|e| BackendError::Device(format!("embedded kernels refused: {e}")))?;
        let spec = reg.target.clone().ok_or_else(|| {
            BackendError::Device("this binary embeds no kernels (a generic build): build it with `cargo xtask build-target --hw <gpu> ...`".into())
        })?;
        let (target, arch) = cuda_arch(&spec)?;
        let mut blobs = BTreeMap::new();
        for name in templates_of(&spec) {
            let k = reg.kernel(name).ok_or_else(|| {
                BackendError::Device(format!(
                    "target {target}: the binary embeds no kernel {name}"
                ))
            })?;
            let ptx = (!k.ptx.is_empty()).then(|| k.ptx.as_bytes().to_vec());
            blobs.insert(
                name.to_string(),
                KernelBlob {
                    name: name.to_string(),
                    cubin: k.cubin.to_vec(),
                    ptx,
                },
            );
        }
        Ok(KernelSet {
            spec,
            target,
            arch,
            blobs,
        })
    }
}

/// The ABI's templates that `spec` compiles: all but the optional ones its family leaves out.
fn templates_of(spec: &TargetSpec) -> Vec<&'static str> {
    metrale_abi::templates()
        .into_iter()
        .filter(|t| !FEATURE_TEMPLATES.contains(t) || spec.kernels.iter().any(|k| k == t))
        .collect()
}

/// The entry points of a [`KernelSet`] loaded onto a device.
pub struct Kernels {
    /// Indexed by `metrale_abi::Entry as usize`; `None` for an optional template the set lacks.
    funcs: Vec<Option<CudaFunction>>,
    /// "cubin" or "ptx": how the modules were loaded.
    pub loaded_from: &'static str,
    _modules: BTreeMap<&'static str, Arc<CudaModule>>,
}

impl Kernels {
    /// Check the device against the set's arch, load every module and look up every entry point.
    pub fn load(dev: &Device, set: &KernelSet) -> Result<Kernels, BackendError> {
        plan::check_arch(&set.arch, &set.target, dev.ordinal, dev.cc, &dev.name)
            .map_err(BackendError::Device)?;
        let mut modules = BTreeMap::new();
        let mut loaded_from = "cubin";
        for name in templates_of(&set.spec) {
            let blob = set.blobs.get(name).ok_or_else(|| {
                BackendError::Device(format!(
                    "kernel set {}: kernel {name} is missing",
                    set.target
                ))
            })?;
            if let Some(ptx) = &blob.ptx {
                metrale_abi::check_ptx(name, &String::from_utf8_lossy(ptx)).map_err(|e| {
                    BackendError::Device(format!(
                        "kernel {name} of {} does not match this binary's ABI ({e}); rebuild the target's kernels with this source tree",
                        set.target
                    ))
                })?;
            }
            let module = match dev
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(blob.cubin.clone()))
            {
                Ok(m) => m,
                Err(e_cubin) => match &blob.ptx {
                    Some(ptx) => {
                        loaded_from = "ptx";
                        let mut p = ptx.clone();
                        p.push(0);
                        dev.ctx
                            .load_module(cudarc::nvrtc::Ptx::from_binary(p))
                            .map_err(|e| {
                                BackendError::Device(format!(
                                "kernel {name}: cubin refused ({e_cubin}) and PTX refused ({e})"
                            ))
                            })?
                    }
                    None => {
                        return Err(BackendError::Device(format!(
                            "kernel {name}: cubin refused by the driver: {e_cubin}"
                        )))
                    }
                },
            };
            modules.insert(name, module);
        }
        let funcs = ENTRIES
            .iter()
            .map(|e| {
                let Some(m) = modules.get(e.template) else {
                    return Ok(None);
                };
                m.load_function(e.entry).map(Some).map_err(dev_err(format!(
                    "kernel {}: entry point {} not found",
                    e.template, e.entry
                )))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Kernels {
            funcs,
            loaded_from,
            _modules: modules,
        })
    }

    /// The loaded function of an entry point (one of a template the set has: [`Kernels::has`]).
    pub fn get(&self, e: metrale_abi::Entry) -> &CudaFunction {
        self.funcs[e as usize].as_ref().unwrap_or_else(|| {
            panic!(
                "entry {:?}: its template is not in this target's kernels (ask Kernels::has first)",
                e
            )
        })
    }

    /// Whether the set has the entry point's template.
    pub fn has(&self, e: metrale_abi::Entry) -> bool {
        self.funcs[e as usize].is_some()
    }
}
