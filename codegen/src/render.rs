//! Rendering a kernel template for a target, and resolving its include closure.
//!
//! Templates are handlebars in strict mode with HTML escaping off. The context is exactly
//! `{ target: "hw/model/quant", hw: {HARDWARE.toml fields}, model: {[model] fields: one rank's
//! shape where `[parallel] tensor` splits the model, `TargetSpec::rank_shape`}, parallel:
//! {tensor}, quant: {[quant] fields}, features: {the target's metrale_core::target::Features: the family's, qkv_rope for an fp8 KV cache}, kernel: {name} }`, plus for CUDA targets `abi: {consts, params}` from `metrale_abi`; a
//! parameter a template uses but the target lacks is an error naming the target, the template and
//! the parameter. The partial `{{> abi}}` renders the ABI's `abi` namespace (constants, device
//! structs); a CUDA template's rendered source ends with the ABI's layout `static_assert`s for the
//! target (`metrale_abi::layout::asserts`).
//!
//! Includes: every quoted `#include "x"` of the rendered source and, transitively, of the headers is
//! resolved relative to the including file, must stay inside `kernels/`, and is read from the source
//! tree; a missing one is an error naming the includer. Angle includes (`<cuda_fp16.h>`) are the
//! toolchain's, covered by its identity. Headers are not templates. Each header is handed to the
//! compiler under the name written in the `#include`, so one include name must mean one file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use metrale_core::target::{BackendKind, TargetSpec};

use crate::CodegenError;

/// A rendered kernel with its closure's contents.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub name: String,
    /// Repo-relative template path, e.g. `kernels/cuda/rmsnorm.cu.hbs`.
    pub template_path: String,
    pub template: Vec<u8>,
    pub source: String,
    /// repo-relative path -> (include name as written, bytes)
    pub headers: BTreeMap<String, (String, Vec<u8>)>,
    /// The handlebars context.
    pub params: serde_json::Value,
}

/// `kernels/<backend>/<name>.<ext>.hbs`, repo-relative.
pub fn template_rel_path(backend: BackendKind, name: &str) -> Option<String> {
    match backend {
        BackendKind::Cuda => Some(format!("kernels/cuda/{name}.cu.hbs")),
        BackendKind::Metal => Some(format!("kernels/metal/{name}.metal.hbs")),
        BackendKind::Cpu => None,
    }
}

/// The handlebars context of `kernel` for `spec`. CUDA kernels also get `abi`: the ABI's constants
/// (`abi.consts`, also rendered by the `{{> abi}}` partial) and the C parameter list of each of this
/// template's entry points (`abi.params.<entry>`), from `metrale_abi`.
pub fn context(spec: &TargetSpec, kernel: &str) -> serde_json::Value {
    let mut c = serde_json::json!({
        "target": spec.id.to_string(),
        "hw": serde_json::to_value(&spec.hardware).expect("hardware serializes"),
        // one rank's shape where the target splits the model over several GPUs
        "model": serde_json::to_value(spec.rank_shape()).expect("model serializes"),
        "parallel": serde_json::to_value(spec.parallel).expect("parallel serializes"),
        "quant": serde_json::to_value(&spec.quant).expect("quant serializes"),
        "features": serde_json::to_value(spec.features()).expect("features serialize"),
        "kernel": {"name": kernel},
    });
    if spec.hardware.backend == BackendKind::Cuda {
        let consts: serde_json::Map<String, serde_json::Value> = metrale_abi::CONSTS
            .iter()
            .map(|(n, v)| (n.to_string(), (*v).into()))
            .collect();
        let params: serde_json::Map<String, serde_json::Value> = metrale_abi::entries_of(kernel)
            .map(|e| (e.entry.to_string(), e.c_params().into()))
            .collect();
        c["abi"] = serde_json::json!({"consts": consts, "params": params});
    }
    c
}

/// What codegen appends to a rendered CUDA template: the `static_assert`s that tie the kernel's
/// layout formulas to the host's for this target (`metrale_abi::layout::asserts`).
fn layout_asserts(spec: &TargetSpec, kernel: &str) -> String {
    if spec.hardware.backend != BackendKind::Cuda {
        return String::new();
    }
    let d = metrale_core::shape::Dims::from_shape(&spec.rank_shape());
    let formats: Vec<_> = [&spec.quant.weights, &spec.quant.embedding]
        .iter()
        .filter_map(|t| metrale_abi::layout::WgFormat::of(t))
        .collect();
    metrale_abi::layout::asserts(
        kernel,
        &d,
        spec.hardware.sm_count.unwrap_or(0) as usize,
        &formats,
        spec.quant.kv_dtype(),
    )
}

fn rel(repo: &Path, p: &Path) -> String {
    p.strip_prefix(repo)
        .unwrap_or(p)
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Renders `kernel` of `spec` from the source tree at `repo`.
pub fn render(repo: &Path, spec: &TargetSpec, kernel: &str) -> Result<Rendered, CodegenError> {
    let target = spec.id.to_string();
    let template_path =
        template_rel_path(spec.hardware.backend, kernel).ok_or_else(|| CodegenError::Template {
            target: target.clone(),
            template: kernel.into(),
            parameter: None,
            message: "the cpu backend has no kernel templates".into(),
        })?;
    let abs = repo.join(&template_path);
    let template = std::fs::read(&abs).map_err(|e| CodegenError::TemplateMissing {
        target: target.clone(),
        kernel: kernel.into(),
        path: abs.clone(),
        detail: e.to_string(),
    })?;
    let text = String::from_utf8(template.clone()).map_err(|e| CodegenError::Template {
        target: target.clone(),
        template: template_path.clone(),
        parameter: None,
        message: format!("not UTF-8: {e}"),
    })?;
    let params = context(spec, kernel);
    let mut hb = handlebars::Handlebars::new();
    hb.set_strict_mode(true);
    hb.register_escape_fn(handlebars::no_escape);
    hb.register_partial("abi", metrale_abi::prelude())
        .expect("the ABI prelude is a valid partial");
    let mut source = hb.render_template(&text, &params).map_err(|e| {
        let (parameter, message) = match e.reason() {
            handlebars::RenderErrorReason::MissingVariable(p) => (
                p.clone(),
                "the target does not define this parameter".to_string(),
            ),
            other => (None, other.to_string()),
        };
        let message = match e.line_no {
            Some(l) => format!("line {l}: {message}"),
            None => message,
        };
        CodegenError::Template {
            target: target.clone(),
            template: template_path.clone(),
            parameter,
            message,
        }
    })?;
    source.push_str(&layout_asserts(spec, kernel));
    let kernels_root = repo.join("kernels");
    let mut headers: BTreeMap<String, (String, Vec<u8>)> = BTreeMap::new();
    let mut by_name: BTreeMap<String, String> = BTreeMap::new();
    let mut queue: Vec<(PathBuf, String)> = vec![(abs.clone(), source.clone())];
    while let Some((file, text)) = queue.pop() {
        for inc in quoted_includes(&text) {
            let dir = file.parent().expect("a file has a parent");
            let resolved = normalize(&dir.join(&inc));
            let includer = rel(repo, &file);
            if !resolved.starts_with(&kernels_root) {
                return Err(CodegenError::Include {
                    file: includer,
                    include: inc,
                    detail: "resolves outside kernels/".into(),
                });
            }
            let r = rel(repo, &resolved);
            match by_name.get(&inc) {
                Some(prev) if prev != &r => {
                    return Err(CodegenError::Include {
                        file: includer,
                        include: inc.clone(),
                        detail: format!("names both {prev} and {r}; use unique header names"),
                    })
                }
                _ => {}
            }
            by_name.insert(inc.clone(), r.clone());
            if headers.contains_key(&r) {
                continue;
            }
            let bytes = std::fs::read(&resolved).map_err(|e| CodegenError::Include {
                file: includer.clone(),
                include: inc.clone(),
                detail: format!("{r}: {e}"),
            })?;
            let t = String::from_utf8(bytes.clone()).map_err(|e| CodegenError::Include {
                file: includer,
                include: inc.clone(),
                detail: format!("{r} is not UTF-8: {e}"),
            })?;
            headers.insert(r, (inc, bytes));
            queue.push((resolved, t));
        }
    }
    Ok(Rendered {
        name: kernel.to_string(),
        template_path,
        template,
        source,
        headers,
        params,
    })
}

/// The `"..."` names of `#include "..."` lines.
pub fn quoted_includes(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let l = line.trim_start();
        let Some(rest) = l.strip_prefix('#') else {
            continue;
        };
        let Some(rest) = rest.trim_start().strip_prefix("include") else {
            continue;
        };
        let rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix('"') {
            if let Some(end) = r.find('"') {
                out.push(r[..end].to_string());
            }
        }
    }
    out
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn includes() {
        let t = "#include \"a.cuh\"\n  #  include \"sub/b.cuh\"\n#include <cuda_fp16.h>\n// #include \"c.cuh\"\n";
        assert_eq!(super::quoted_includes(t), vec!["a.cuh", "sub/b.cuh"]);
    }
}
