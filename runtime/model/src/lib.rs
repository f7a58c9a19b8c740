//! metrale-model: everything about a model that is not computation.
//!
//! Owns: reading a checkpoint (a GGUF file, or an HF directory of config.json + safetensors +
//! tokenizer files) into one [`Model`]: the typed [`ModelConfig`], the [`Weights`] (memory-mapped,
//! named with GGUF llama names, shapes in ggml order), the [`Tokenizer`] and the [`ChatTemplate`].
//! It does not run anything: backends read `Model::weights` and `Model::config`.
//!
//! Invariants:
//! - Only the families of [`config::Family`] (llama, qwen3) are accepted; anything else is refused
//!   naming what was found.
//! - A malformed file is a [`ModelError`] naming the file and the field, never a panic; no allocation
//!   is sized from a count read from a file before that count is bounded by the file's size.
//! - Only regular files are opened ([`files`]): a FIFO, socket or device given as a model path or
//!   found in an HF directory is refused, naming it, instead of blocking.
//! - Weights are zero-copy views of the memory maps, except the Q/K projections (and Q/K norms) of
//!   files in HF's rope layout (every HF folder; GGUFs of families with
//!   [`config::Family::gguf_rope_halves`]), which are row-permuted to GGUF llama's rope convention
//!   (adjacent pairs) and owned (see [`hf::rope_pairs`]). Every backend implements exactly that one
//!   rope convention.
//! - After `Model::load`, every tensor the family's forward pass reads exists with the shape the
//!   config implies (see [`config::validate_model`]).

pub mod chat;
pub mod config;
pub mod error;
pub mod files;
pub mod fp8;
pub mod gguf;
pub mod gguf_writer;
pub mod hf;
pub mod shard;
pub mod tokenizer;
pub mod weights;

pub use chat::{ChatMessage, ChatTemplate, RenderError, RenderLimits};
pub use config::{Family, ModelConfig, RopeScaling};
pub use error::ModelError;
pub use tokenizer::Tokenizer;
pub use weights::{TensorRef, Weights};

use std::path::{Path, PathBuf};

/// Which kind of checkpoint a model was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Gguf,
    HfSafetensors,
}

/// A loaded model: config, weights, tokenizer and chat template.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub path: PathBuf,
    pub format: Format,
}

impl Model {
    /// Load a `.gguf` file or an HF checkpoint directory.
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        // A FIFO, socket or device is refused here, by a stat, before anything is opened.
        if files::model_path_is_dir(path)? {
            return hf::load(path);
        }
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let mut f = files::open(path)?;
            let n = f.read(&mut magic).map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            if n == 4
                && magic != gguf::MAGIC
                && path.extension().is_some_and(|e| e == "safetensors")
            {
                return Err(ModelError::Mismatch {
                    path: path.to_path_buf(),
                    field: "path".into(),
                    expected:
                        "a .gguf file or an HF checkpoint directory (pass the directory that holds \
                               config.json, not the .safetensors file)"
                            .into(),
                    got: "a .safetensors file".into(),
                });
            }
        }
        Model::from_gguf(gguf::GgufFile::open(path)?)
    }

    /// The chat template, or an error saying the model has none (pass one with --chat-template).
    pub fn require_chat_template(&self) -> Result<&ChatTemplate, ModelError> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| ModelError::Missing {
                path: self.path.clone(),
                field: "chat template".into(),
                hint: "the model ships none; give one explicitly (e.g. --chat-template FILE)"
                    .into(),
            })
    }
}

impl Model {
    /// Build a model from a parsed GGUF file (what [`Model::load`] does after opening a `.gguf`).
    pub fn from_gguf(g: gguf::GgufFile) -> Result<Model, ModelError> {
        let path = g.path.clone();
        let path = path.as_path();
        let mut config = ModelConfig::from_gguf(&g)?;
        let tokenizer = Tokenizer::from_gguf(&g, config.bos, config.eos.clone(), config.add_bos)?;
        if tokenizer.vocab_size() > config.vocab {
            return Err(ModelError::Mismatch {
                path: path.to_path_buf(),
                field: "metadata 'tokenizer.ggml.tokens'".into(),
                expected: format!("at most token_embd's {} rows", config.vocab),
                got: format!("{} tokens", tokenizer.vocab_size()),
            });
        }
        let text = |id: Option<u32>| {
            id.map(|i| String::from_utf8_lossy(tokenizer.token_bytes_ref(i)).into_owned())
        };
        let bos_text = text(config.bos).unwrap_or_default();
        let eos_text = text(config.eos.first().copied()).unwrap_or_default();
        let chat_template = chat::ChatTemplate::from_gguf(&g, &bos_text, &eos_text)?;
        let gguf::GgufFile { header, map, .. } = g;
        let mut weights = Weights::new(path.to_path_buf(), vec![map]);
        for mut t in header.tensors {
            // gpt-oss's GGUFs name the norm before the MLP `post_attention_norm`
            if config.family == Family::GptOss {
                if let Some(l) = t.name.strip_suffix(".post_attention_norm.weight") {
                    t.name = format!("{l}.ffn_norm.weight");
                }
            }
            // fused projections (Phi-3): each part its own tensor (mapped), Q and K then permuted
            if let Some(parts) = hf::fused_parts(&config, &t.name, t.dtype, &t.shape, path)? {
                for (name, shape, off, len) in parts {
                    let start = t.file_offset + off;
                    let data = weights.maps[0].get(start..start + len).unwrap_or(&[]);
                    let source =
                        match hf::rope_pairs(&name, t.dtype, &shape, data, &config, path, &t.name)?
                        {
                            Some(bytes) => weights::Source::Owned(bytes),
                            None => weights::Source::Mapped {
                                map: 0,
                                offset: start,
                                len,
                            },
                        };
                    weights.insert(name, t.dtype, shape, source)?;
                }
                continue;
            }
            // families whose GGUF rows keep HF's RoPE layout: Q/K rows to adjacent pairs (copied)
            let pairs = if config.family.gguf_rope_halves() {
                let end = t.file_offset.saturating_add(t.n_bytes);
                let data = weights.maps[0].get(t.file_offset..end).unwrap_or(&[]);
                hf::rope_pairs(&t.name, t.dtype, &t.shape, data, &config, path, &t.name)?
            } else {
                None
            };
            let source = match pairs {
                Some(bytes) => weights::Source::Owned(bytes),
                None => weights::Source::Mapped {
                    map: 0,
                    offset: t.file_offset,
                    len: t.n_bytes,
                },
            };
            weights.insert(t.name, t.dtype, t.shape, source)?;
        }
        config::fill_long_rope(&mut config, &weights)?;
        config::validate_model(&config, &weights)?;
        Ok(Model {
            config,
            weights,
            tokenizer,
            chat_template,
            path: path.to_path_buf(),
            format: Format::Gguf,
        })
    }
}
