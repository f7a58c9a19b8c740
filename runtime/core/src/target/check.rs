//! The target validator: what a parsed [`TargetSpec`] must satisfy before anything builds from it
//! (the module's "Invariants"). Each part checks one side of the spec, in the order a reader of
//! the files meets them; the first fault is the error, naming the file, the field, what was
//! expected and what was found.

use super::{BackendKind, TargetError, TargetSpec, FAMILIES, FEATURE_TEMPLATES};

/// One spec under check, with the paths its errors name.
struct Check<'a> {
    spec: &'a TargetSpec,
    hw_path: &'a str,
    model_path: &'a str,
}

type Checked = Result<(), TargetError>;

fn invalid(path: &str, field: &str, expected: String, got: String) -> TargetError {
    TargetError::Invalid {
        path: path.to_string(),
        field: field.to_string(),
        expected,
        got,
    }
}

impl TargetSpec {
    pub(super) fn check(&self, hw_path: &str, model_path: &str) -> Checked {
        let c = Check {
            spec: self,
            hw_path,
            model_path,
        };
        c.parallel()?;
        c.names()?;
        c.hardware()?;
        c.model()?;
        c.rope()?;
        c.quant()?;
        c.kernels()
    }
}

impl Check<'_> {
    /// An error in the model's file (MODEL.toml and what it extends).
    fn model_err(&self, field: &str, expected: String, got: String) -> TargetError {
        invalid(self.model_path, field, expected, got)
    }

    /// An error in HARDWARE.toml.
    fn hw_err(&self, field: &str, expected: String, got: String) -> TargetError {
        invalid(self.hw_path, field, expected, got)
    }

    /// `[parallel] tensor`: at least 1, and a degree above 1 only where the model splits into
    /// that many ranks on a cuda target without the fused batch-1 kernel.
    fn parallel(&self) -> Checked {
        let s = self.spec;
        let tp = s.parallel.tensor;
        if tp == 0 {
            return Err(self.model_err("parallel.tensor", "at least 1".into(), "0".into()));
        }
        if tp == 1 {
            return Ok(());
        }
        let m = &s.model;
        let xffn = m.experts.as_ref().map_or(m.ffn, |x| x.ffn);
        let why = if s.hardware.backend != BackendKind::Cuda {
            Some(format!(
                "a cuda target (this one's backend is {})",
                s.hardware.backend
            ))
        } else if s.kernels.iter().any(|k| k == "decode") {
            Some(
                "no \"decode\" kernel (the fused batch-1 kernel computes whole layers on one GPU)"
                    .into(),
            )
        } else if !m.heads.is_multiple_of(tp) {
            Some(format!("query heads ({}) a multiple of {tp}", m.heads))
        } else if !(m.kv_heads.is_multiple_of(tp) || tp.is_multiple_of(m.kv_heads)) {
            Some(format!(
                "KV heads ({}) a multiple or divisor of {tp}",
                m.kv_heads
            ))
        } else if !xffn.is_multiple_of(tp * 32) || !(m.heads / tp * m.head_dim).is_multiple_of(32) {
            Some(format!(
                "each rank's FFN rows ({xffn} / {tp}) and query width a multiple of 32 (the \
                 row-parallel products' rows are whole 32-element blocks)"
            ))
        } else {
            None
        };
        match why {
            Some(why) => Err(self.model_err(
                "parallel.tensor",
                format!("a degree that splits the model: {why}"),
                tp.to_string(),
            )),
            None => Ok(()),
        }
    }

    /// The hardware, model and quant names are the target's folder names.
    fn names(&self) -> Checked {
        let s = self.spec;
        if s.hardware.name != s.id.hw {
            return Err(self.hw_err(
                "name",
                format!("\"{}\" (the folder name)", s.id.hw),
                format!("\"{}\"", s.hardware.name),
            ));
        }
        for (field, name, folder) in [
            ("model.name", &s.model.name, &s.id.model),
            ("quant.name", &s.quant.name, &s.id.quant),
        ] {
            if name != folder {
                return Err(self.model_err(
                    field,
                    format!("\"{folder}\" (the folder name)"),
                    format!("\"{name}\""),
                ));
            }
        }
        Ok(())
    }

    /// What each backend needs of HARDWARE.toml.
    fn hardware(&self) -> Checked {
        let h = &self.spec.hardware;
        match h.backend {
            BackendKind::Cuda => {
                for (field, present) in [
                    ("cubin_arch", h.cubin_arch.is_some()),
                    ("ptx_arch", h.ptx_arch.is_some()),
                    ("sm_count", h.sm_count.is_some()),
                    ("smem_per_block_kib", h.smem_per_block_kib.is_some()),
                    ("compute_capability", h.compute_capability.is_some()),
                    ("attention_cluster", h.attention_cluster.is_some()),
                    ("decode_split", h.decode_split.is_some()),
                ] {
                    if !present {
                        return Err(self.hw_err(
                            field,
                            "a value (required for backend = \"cuda\")".into(),
                            "nothing".into(),
                        ));
                    }
                }
                if let Some(a) = h.cubin_arch.as_ref().filter(|a| !a.starts_with("sm_")) {
                    return Err(self.hw_err(
                        "cubin_arch",
                        "sm_<NN>[a], e.g. sm_90a".into(),
                        a.clone(),
                    ));
                }
                if let Some(a) = h.ptx_arch.as_ref().filter(|a| !a.starts_with("compute_")) {
                    return Err(self.hw_err(
                        "ptx_arch",
                        "compute_<NN>[a], e.g. compute_90".into(),
                        a.clone(),
                    ));
                }
            }
            BackendKind::Metal if h.metal_std.is_none() => {
                return Err(self.hw_err(
                    "metal_std",
                    "a value such as \"metal3.1\" (required for backend = \"metal\")".into(),
                    "nothing".into(),
                ));
            }
            BackendKind::Metal | BackendKind::Cpu => {}
        }
        Ok(())
    }

    /// The model's shape and family: consistent sizes, a known family, experts exactly for the
    /// mixture family, and only what the backend has kernels for.
    fn model(&self) -> Checked {
        let s = self.spec;
        let m = &s.model;
        let backend = s.hardware.backend;
        let cpu = backend == BackendKind::Cpu;
        if m.heads == 0 || m.kv_heads == 0 || !m.heads.is_multiple_of(m.kv_heads) {
            return Err(self.model_err(
                "model.kv_heads",
                format!("a divisor of heads ({})", m.heads),
                m.kv_heads.to_string(),
            ));
        }
        if !FAMILIES.contains(&m.family.as_str()) {
            return Err(self.model_err(
                "model.family",
                format!("one of {}", FAMILIES.join(", ")),
                m.family.clone(),
            ));
        }
        if let Some(x) = &m.experts {
            if x.count == 0 || x.used == 0 || x.used > x.count || x.ffn == 0 {
                return Err(self.model_err(
                    "model.experts",
                    "count > 0, 1 <= used <= count, ffn > 0".into(),
                    format!("count {}, used {}, ffn {}", x.count, x.used, x.ffn),
                ));
            }
        }
        let routed = super::features(&m.family).is_some_and(|f| f.moe);
        if routed != m.experts.is_some() {
            return Err(self.model_err(
                "model.experts",
                "a [model.experts] table exactly for the families with routed experts \
                 (qwen3moe, gpt-oss)"
                    .into(),
                format!("family {}", m.family),
            ));
        }
        // the family's, and qkv_rope where the KV cache is fp8 (TargetSpec::features)
        let features = s.features();
        let unkernelled = features.post_norms
            || features.gelu
            || features.embed_scale
            || features.norm_plus_one
            || features.attn_sinks
            || features.oai_moe
            || features.out_bias
            || m.sliding.is_some()
            || m.query_pre_attn_scalar.is_some();
        if unkernelled && !cpu {
            return Err(self.model_err(
                "model.family",
                "a family with kernels on this backend (the gemma3 block's post-norms, GELU MLP, \
                 embedding scale and sliding windows, and gpt-oss's attention sinks, biases and \
                 clamped experts, run on the cpu backend only: build a cpu target)"
                    .into(),
                m.family.clone(),
            ));
        }
        if let Some(w) = &m.sliding {
            if w.window == 0 || w.pattern == 0 || w.rope_theta <= 0.0 {
                return Err(self.model_err(
                    "model.sliding",
                    "window > 0, pattern > 0, rope_theta > 0".into(),
                    format!("{w:?}"),
                ));
            }
        }
        if features.moe && backend == BackendKind::Metal {
            return Err(self.model_err(
                "model.family",
                "a dense family on metal targets (routed experts have no Metal kernels: build a cpu or cuda target)".into(),
                m.family.clone(),
            ));
        }
        // a feature's kernel for a family without the feature computes another block; a kernel the
        // family needs and the list lacks is refused where the kernels load (the CUDA backend)
        if backend == BackendKind::Cuda {
            for t in FEATURE_TEMPLATES {
                if !features.wants(t) && s.kernels.iter().any(|k| k == t) {
                    return Err(self.model_err(
                        "kernels",
                        format!("a list without \"{t}\" for the {} family", m.family),
                        format!("{:?}", s.kernels),
                    ));
                }
            }
        }
        // the per-stage kernels keep the query width and the hidden size apart (h200/qwen3-0.6b:
        // 2048 and 1024); the fused batch-1 kernel is compiled and tested where they are equal
        if m.heads * m.head_dim != m.hidden && !cpu && features.fused_decode {
            return Err(self.model_err(
                "model.head_dim",
                format!("hidden / heads = {}", m.hidden / m.heads.max(1)),
                m.head_dim.to_string(),
            ));
        }
        for (field, v) in [
            ("model.layers", m.layers),
            ("model.ffn", m.ffn),
            ("model.vocab", m.vocab),
            ("model.max_context", m.max_context),
        ] {
            if v == 0 {
                return Err(self.model_err(field, "a positive number".into(), "0".into()));
            }
        }
        Ok(())
    }

    /// The rotary embedding: the rotated width, LongRoPE's factors (cpu only, as a partial
    /// rotary width), and the one `rope_scaling` type the kernels know.
    fn rope(&self) -> Checked {
        let s = self.spec;
        let m = &s.model;
        let rot = m.rotary_dim.unwrap_or(m.head_dim);
        if rot < 2 || rot > m.head_dim || !rot.is_multiple_of(2) {
            return Err(self.model_err(
                "model.rotary_dim",
                format!("an even number in 2..={}", m.head_dim),
                rot.to_string(),
            ));
        }
        if let Some(lr) = &m.longrope {
            let ok = |v: &[f64]| v.len() == rot as usize / 2 && v.iter().all(|f| *f > 0.0);
            if !ok(&lr.short_factor) || !ok(&lr.long_factor) || m.rope_scaling.is_some() {
                return Err(self.model_err(
                    "model.longrope",
                    format!(
                        "{} positive factors in each list (one per rotated pair), and no \
                         [model.rope_scaling] beside it",
                        rot / 2
                    ),
                    format!("{} and {}", lr.short_factor.len(), lr.long_factor.len()),
                ));
            }
        }
        if let Some(y) = &m.yarn {
            if y.factor <= 1.0
                || y.original_max_position_embeddings < 2
                || y.beta_fast <= y.beta_slow
                || y.beta_slow <= 0.0
                || m.rope_scaling.is_some()
                || m.longrope.is_some()
            {
                return Err(self.model_err(
                    "model.yarn",
                    "factor > 1, original_max_position_embeddings > 1, beta_fast > beta_slow > 0, \
                     and no other RoPE scaling beside it"
                        .into(),
                    format!("{y:?}"),
                ));
            }
        }
        if (m.rotary_dim.is_some_and(|r| r != m.head_dim)
            || m.longrope.is_some()
            || m.yarn.is_some())
            && s.hardware.backend != BackendKind::Cpu
        {
            return Err(self.model_err(
                "model.rotary_dim / model.longrope / model.yarn",
                format!(
                    "none (a partial rotary embedding, LongRoPE and YaRN run on the cpu backend \
                     only; the {} kernels rotate whole heads without factors)",
                    s.hardware.backend
                ),
                "one of them".into(),
            ));
        }
        if let Some(rs) = m.rope_scaling.as_ref().filter(|r| r.rope_type != "llama3") {
            return Err(self.model_err(
                "model.rope_scaling.rope_type",
                "\"llama3\"".into(),
                rs.rope_type.clone(),
            ));
        }
        Ok(())
    }

    /// What the target serves and how: its model types, weight and embedding formats, tool-call
    /// format, KV cache type and the activations of the matrix-vector and GEMM paths.
    fn quant(&self) -> Checked {
        let s = self.spec;
        let q = &s.quant;
        if s.model_types.is_empty() {
            return Err(self.model_err(
                "model_types",
                "at least one [[model_types]] entry".into(),
                "none".into(),
            ));
        }
        for f in [&q.weights, &q.embedding] {
            let fp8 = f == "fp8" && std::ptr::eq(f, &q.weights);
            if !fp8 && !["q4_0", "q4_1", "q8_0", "bf16", "f16", "f32"].contains(&f.as_str()) {
                return Err(self.model_err(
                    "quant.weights/embedding",
                    "one of q4_0, q4_1, q8_0, bf16, f16, f32 (and fp8 for the layer weights)"
                        .into(),
                    f.clone(),
                ));
            }
        }
        if q.weights == "fp8" {
            self.fp8()?;
        }
        if let Some(f) = &s.behavior.tool_call_format {
            if !["hermes", "llama3_json"].contains(&f.as_str()) {
                return Err(self.model_err(
                    "behavior.tool_call_format",
                    "hermes or llama3_json".into(),
                    f.clone(),
                ));
            }
        }
        match crate::shape::KvDtype::parse(&q.kv) {
            None => {
                return Err(self.model_err("quant.kv", "f32, bf16 or fp8".into(), q.kv.clone()))
            }
            Some(crate::shape::KvDtype::Fp8) if s.hardware.backend != BackendKind::Cpu => {
                // on CUDA: written by qkv_rope, a head vector per warp, read by `attention` four
                // bytes a lane (head_dim 128 or more); decode_1 reads f32 or bf16 caches only
                let why = if s.hardware.backend != BackendKind::Cuda {
                    Some(format!(
                        "f32 or bf16 (an fp8 KV cache runs on the cpu and cuda backends; the {} \
                         kernels read f32 or bf16)",
                        s.hardware.backend
                    ))
                } else if !s.model.head_dim.is_multiple_of(128) {
                    Some(format!(
                        "f32 or bf16 (an fp8 cache's kernels read 4 bytes a lane: head_dim a \
                         multiple of 128, this model's is {})",
                        s.model.head_dim
                    ))
                } else if s.kernels.iter().any(|k| k == "decode") {
                    Some(
                        "f32 or bf16, or fp8 with a kernel list without \"decode\" (the fused \
                         batch-1 kernel reads f32 or bf16 caches)"
                            .into(),
                    )
                } else {
                    None
                };
                if let Some(w) = why {
                    return Err(self.model_err("quant.kv", w, q.kv.clone()));
                }
            }
            Some(_) => {}
        }
        // 16-bit activations exist for q4_1 weights only, as rows (`activations = "i16"`) and as
        // the GEMMs' f16 inputs (`gemm_activations = "f16"`)
        for (field, got, plain, sixteen, what) in [
            ("quant.activations", &q.activations, "f32", "i16", "16-bit"),
            (
                "quant.gemm_activations",
                &q.gemm_activations,
                "split",
                "f16",
                "f16 GEMM",
            ),
        ] {
            if got == plain || (got == sixteen && q.weights == "q4_1") {
                continue;
            }
            let expected = if got == sixteen {
                format!(
                    "{plain} ({what} activations need q4_1 weights, these are {})",
                    q.weights
                )
            } else {
                format!("{plain} or {sixteen}")
            };
            return Err(self.model_err(field, expected, got.clone()));
        }
        Ok(())
    }

    /// FP8 layer weights (`quant.weights = "fp8"`): CUDA kernels for sm_89 and later (e4m3
    /// conversions), per-stage only (the fused batch-1 kernel scales its products after the
    /// RMSNorm, and an fp8 product quantizes the normalised row first), dense families (the
    /// routed experts' kernels have no fp8 form).
    fn fp8(&self) -> Checked {
        let s = self.spec;
        let arch = s.hardware.cubin_arch.as_deref().unwrap_or("");
        let sm = arch
            .strip_prefix("sm_")
            .map(|a| a.trim_end_matches(|c: char| c.is_ascii_alphabetic()))
            .and_then(|a| a.parse::<u32>().ok());
        let why = if s.hardware.backend != BackendKind::Cuda {
            Some(format!(
                "a cuda target (this one's backend is {}; the cpu backend reads FP8 checkpoints \
                 with its bf16 or q4_1 targets)",
                s.hardware.backend
            ))
        } else if sm.is_none_or(|n| n < 89) {
            Some(format!(
                "a GPU of sm_89 or later (cubin_arch {arch:?}): the e4m3 conversions"
            ))
        } else if s.kernels.iter().any(|k| k == "decode") {
            Some(
                "a kernel list without \"decode\" (the fused batch-1 kernel has no fp8 form)"
                    .into(),
            )
        } else if s.model.features().moe {
            Some("a dense family (the routed experts' kernels have no fp8 form)".into())
        } else {
            None
        };
        match why {
            Some(w) => Err(self.model_err("quant.weights", w, "fp8".into())),
            None => Ok(()),
        }
    }

    /// The kernel template list: names of word characters, each once, none for the cpu backend.
    fn kernels(&self) -> Checked {
        let s = self.spec;
        let mut seen = std::collections::BTreeSet::new();
        for k in &s.kernels {
            if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(self.model_err(
                    "kernels",
                    "names of [A-Za-z0-9_]+".into(),
                    format!("\"{k}\""),
                ));
            }
            if !seen.insert(k) {
                return Err(self.model_err(
                    "kernels",
                    "each kernel once".into(),
                    format!("\"{k}\" twice"),
                ));
            }
        }
        if s.hardware.backend == BackendKind::Cpu && !s.kernels.is_empty() {
            return Err(self.model_err(
                "kernels",
                "an empty list (the cpu backend has no compiled kernels)".into(),
                format!("{:?}", s.kernels),
            ));
        }
        Ok(())
    }
}
