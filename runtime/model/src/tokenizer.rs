//! Tokenizer: text <-> token ids, built on the `tokenizers` crate.
//!
//! Owns: building a tokenizer from a GGUF vocabulary (`tokenizer.ggml.*`) or an HF `tokenizer.json`,
//! encoding with or without special-token parsing, decoding, and each token's raw bytes.
//!
//! GGUF `gpt2`-type vocabularies become a byte-level BPE model (tokens + merges) whose pre-tokenizer is
//! chosen by `tokenizer.ggml.pre`, with the exact regexes of llama.cpp (src/llama-vocab.cpp):
//! - `smollm`: `\p{N}` (every digit alone), then the GPT-2 regex;
//! - `gpt2` / `gpt-2`: the GPT-2 regex `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`;
//! - `llama-bpe` / `llama3` / `llama-v3`: the llama3 regex, with whole-word vocabulary hits taking
//!   precedence over merges (llama.cpp's `ignore_merges`);
//! - `dbrx` / `smaug-bpe` (Phi-4's GGUFs): the llama3 regex, merges as usual;
//! - `qwen2` (Qwen2, Qwen2.5, Qwen3 GGUFs): the llama3 regex with every digit alone (`\p{N}` where
//!   llama3 has `\p{N}{1,3}`), merges as usual;
//! - `tekken` (Mistral-Nemo, Mistral Small 3): Mistral's regex (case runs within words, digits
//!   alone), whole-word vocabulary hits first as llama3's;
//! - `gpt-4o` / `llama4` (gpt-oss's o200k, Llama 4): o200k's regex (tekken's case runs with
//!   contractions attached, digits in threes), merges as usual.
//!
//! Each regex splits keeping the unmatched stretches as pieces (llama.cpp's behaviour), then bytes are
//! mapped to GPT-2's printable alphabet. Any other `pre` value is refused with an error that lists the
//! supported ones: guessing a pre-tokenizer silently produces wrong ids.
//!
//! Invariants: control tokens (GGUF token type 3) and unknown tokens (2) are *special*: they are
//! matched in the input only when `parse_special` is set, otherwise their text is tokenized as plain
//! text (llama.cpp's `parse_special`); user-defined tokens (4) are always matched, as in llama.cpp and
//! HF. `encode` never adds special tokens except the BOS it is asked for. `token_bytes(id)` is the exact
//! byte string a token stands for, so `decode` of byte-level vocabularies is the lossy UTF-8 of the
//! concatenated `token_bytes`.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use serde_json::Value as Json;
use std::collections::HashMap;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// The GPT-2 pre-tokenizer regex as llama.cpp writes it.
pub const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// The llama3 pre-tokenizer regex as llama.cpp adapts it (case-insensitive contractions spelled out).
pub const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The qwen2 pre-tokenizer regex as llama.cpp adapts it from Qwen's tokenizer.json (whose
/// `(?i:'s|...)` group it spells out): the llama3 regex with single digits.
pub const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken pre-tokenizer regex (Mistral-Nemo, Mistral Small 3, Pixtral 12B) as its
/// tokenizer.json writes it (llama.cpp spells its letter classes out for its own regex engine):
/// a word is an optional non-letter, then capitals and lower case after them (or capitals alone),
/// so "helloWorld" splits as "hello" "World"; digits alone; `/` kept with a run of punctuation.
pub const TEKKEN_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k's pre-tokenizer regex (GGUF `gpt-4o`: gpt-oss; `llama4`: Llama 4) as gpt-oss's
/// tokenizer.json writes it: tekken's case runs within words, each with an optional contraction,
/// and digits in runs of up to three.
pub const GPT4O_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The `tokenizer.ggml.pre` values this reader supports.
pub const SUPPORTED_PRE: &str = "smollm, gpt2 (gpt-2, phi-2, exaone4), llama-bpe (llama3, \
     llama-v3, falcon3, falcon-h1, pixtral, midm-2.0, lfm2), dbrx (smaug-bpe; Phi-4), qwen2 \
     (deepseek-r1-qwen, kormo, f2llmv2, megrez), tekken, gpt-4o (llama4, kanana2, talkie)";

/// GGUF token types (llama_token_type).
mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

/// How a vocabulary entry's string maps to the bytes it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ByteMode {
    /// GPT-2 byte-level alphabet (each char is one byte).
    ByteLevel,
    /// SentencePiece style: `▁` is a space, `<0xAB>` is the byte 0xAB.
    SentencePiece,
    /// The string's own UTF-8 bytes.
    Raw,
}

/// A tokenizer with the model's special ids.
pub struct Tokenizer {
    /// Matches special (control) tokens in the input.
    with_special: tokenizers::Tokenizer,
    /// Same model without the special tokens registered: their text is tokenized as plain text.
    plain: tokenizers::Tokenizer,
    /// Raw bytes of each id.
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    byte_mode: ByteMode,
    bos: Option<u32>,
    eos: Vec<u32>,
    add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

fn tk_err(msg: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        msg: msg.to_string(),
    }
}

/// GPT-2's bytes_to_unicode, inverted: printable char -> byte.
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut m = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        m.insert(char::from_u32(c).expect("valid code point"), b as u8);
    }
    m
}

fn token_to_bytes(tok: &str, mode: ByteMode, bl: &HashMap<char, u8>) -> Vec<u8> {
    match mode {
        ByteMode::ByteLevel => {
            let mut out = Vec::with_capacity(tok.len());
            for c in tok.chars() {
                match bl.get(&c) {
                    Some(b) => out.push(*b),
                    None => {
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
            out
        }
        ByteMode::SentencePiece => {
            if tok.len() == 6 && tok.starts_with("<0x") && tok.ends_with('>') {
                if let Ok(b) = u8::from_str_radix(&tok[3..5], 16) {
                    return vec![b];
                }
            }
            tok.replace('\u{2581}', " ").into_bytes()
        }
        ByteMode::Raw => tok.as_bytes().to_vec(),
    }
}

fn pre_tokenizer(pre: &str, path: &std::path::Path) -> Result<(PreTokenizerWrapper, bool)> {
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            tokenizers::pre_tokenizers::split::SplitPattern::Regex(re.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| tk_err(format!("regex {re:?}: {e}")))?
        .into())
    };
    // use_regex = false: the Split steps above already did the splitting; ByteLevel only maps bytes.
    let bytes: PreTokenizerWrapper = ByteLevel::new(false, false, false).into();
    let (steps, ignore_merges) = match pre {
        "smollm" => (vec![split(r"\p{N}")?, split(GPT2_REGEX)?, bytes], false),
        // the names llama.cpp gives each of these pre-tokenizers (DeepSeek-R1's Qwen distills are
        // qwen2's, Falcon 3's and Pixtral's llama3's)
        "gpt2" | "gpt-2" | "phi-2" | "exaone4" => (vec![split(GPT2_REGEX)?, bytes], false),
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => (vec![split(LLAMA3_REGEX)?, bytes], true),
        // llama3's regex, the merges as usual (Phi-4's GGUFs say dbrx)
        "dbrx" | "smaug-bpe" => (vec![split(LLAMA3_REGEX)?, bytes], false),
        "tekken" => (vec![split(TEKKEN_REGEX)?, bytes], true),
        // o200k (gpt-oss; Llama 4's GGUFs say llama4), the merges as usual
        "gpt-4o" | "llama4" | "kanana2" | "talkie" => (vec![split(GPT4O_REGEX)?, bytes], false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => {
            (vec![split(QWEN2_REGEX)?, bytes], false)
        }
        other => {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                field: "metadata 'tokenizer.ggml.pre'".into(),
                value: other.into(),
                supported: SUPPORTED_PRE.into(),
            })
        }
    };
    Ok((Sequence::new(steps).into(), ignore_merges))
}

/// A SentencePiece BPE vocabulary (GGUF `tokenizer.ggml.model = "llama"`: pieces, scores, types;
/// Llama 2, Mistral, Gemma) as a `tokenizers` BPE model, built as HF's converter builds one: a merge
/// (l, r) for every normal piece whose two halves are pieces, ranked by the merged piece's score
/// (ties by the halves' ids); unknown characters fall back to the `<0xXX>` byte pieces; spaces are
/// `▁`, one prefixed to each stretch of text where the vocabulary says
/// (`tokenizer.ggml.add_space_prefix`, default true; false for Gemma) and stripped again when
/// decoding.
fn sentencepiece(
    tokens: &[&str],
    scores: &[f32],
    types: &[i64],
    space_prefix: bool,
    path: &std::path::Path,
) -> Result<tokenizers::Tokenizer> {
    use tokenizers::decoders::{
        byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as Decoders, strip::Strip,
    };
    use tokenizers::normalizers::prepend::Prepend;
    use tokenizers::normalizers::replace::Replace;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let mut merges: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    for (t, (&score, &ty)) in tokens.iter().zip(scores.iter().zip(types)) {
        if ty != token_type::NORMAL && ty != token_type::USER_DEFINED {
            continue;
        }
        for (i, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(i);
            if let (Some(&a), Some(&b)) = (vocab.get(l), vocab.get(r)) {
                merges.push((score, a, b, l, r));
            }
        }
    }
    // by score, best first; within a score by the halves' ids (a stable order)
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then((x.1, x.2).cmp(&(y.1, y.2))));
    let merges = merges
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_string(), r.to_string()))
        .collect();
    let unk = tokens
        .iter()
        .zip(types)
        .find(|(_, &ty)| ty == token_type::UNKNOWN)
        .map(|(t, _)| t.to_string());
    let mut b = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        b = b.unk_token(u);
    }
    let bpe = b.build().map_err(|e| {
        tk_err(format!(
            "{}: building the SentencePiece model: {e}",
            path.display()
        ))
    })?;
    let mut t = tokenizers::Tokenizer::new(bpe);
    // a space prefixed to every stretch of text (after each special token too, as llama.cpp
    // does), whether or not it starts with one (as sentencepiece does), then spaces as `▁`
    let mut norm: Vec<tokenizers::NormalizerWrapper> = Vec::new();
    if space_prefix {
        norm.push(Prepend::new("\u{2581}".into()).into());
    }
    norm.push(
        Replace::new(" ", "\u{2581}")
            .map_err(|e| tk_err(format!("normalizer: {e}")))?
            .into(),
    );
    t.with_normalizer(Some(tokenizers::normalizers::Sequence::new(norm)));
    let mut dec: Vec<tokenizers::DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ")
            .map_err(|e| tk_err(format!("decoder: {e}")))?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        dec.push(Strip::new(' ', 1, 0).into());
    }
    t.with_decoder(Some(Decoders::new(dec)));
    Ok(t)
}

impl Tokenizer {
    /// Build from a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE, `model = gpt2`).
    pub fn from_gguf(
        g: &GgufFile,
        bos: Option<u32>,
        eos: Vec<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        let path = g.path.as_path();
        let model = g.req_str("tokenizer.ggml.model")?;
        let spm = match model {
            "gpt2" => false,
            "llama" => true,
            _ => {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    field: "metadata 'tokenizer.ggml.model'".into(),
                    value: model.into(),
                    supported: "gpt2 (byte-level BPE), llama (SentencePiece)".into(),
                })
            }
        };
        let pre = match spm {
            // a SentencePiece vocabulary splits nothing before its merges
            true => "default",
            false => g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default"),
        };
        let pre_name = if pre == "default" {
            "default (absent)"
        } else {
            pre
        };
        let (pre_tok, ignore_merges) = if spm {
            (None, false)
        } else {
            let (p, i) = pre_tokenizer(pre, path).map_err(|e| match e {
                ModelError::Unsupported {
                    path,
                    field,
                    supported,
                    ..
                } => ModelError::Unsupported {
                    path,
                    field,
                    value: pre_name.into(),
                    supported,
                },
                e => e,
            })?;
            (Some(p), i)
        };
        let tokens =
            g.opt_str_array("tokenizer.ggml.tokens")?
                .ok_or_else(|| ModelError::Missing {
                    path: path.to_path_buf(),
                    field: "metadata 'tokenizer.ggml.tokens'".into(),
                    hint: String::new(),
                })?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(ModelError::Mismatch {
                path: path.to_path_buf(),
                field: "metadata 'tokenizer.ggml.tokens'".into(),
                expected: "1..2^32 tokens".into(),
                got: tokens.len().to_string(),
            });
        }
        let types = match g.opt_int_array("tokenizer.ggml.token_type")? {
            Some(t) if t.len() == tokens.len() => t,
            Some(t) => {
                return Err(ModelError::Mismatch {
                    path: path.to_path_buf(),
                    field: "metadata 'tokenizer.ggml.token_type'".into(),
                    expected: format!("{} entries (one per token)", tokens.len()),
                    got: t.len().to_string(),
                })
            }
            None => vec![token_type::NORMAL; tokens.len()],
        };
        let merges_raw = g
            .opt_str_array("tokenizer.ggml.merges")?
            .unwrap_or_default();
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (i, m) in merges_raw.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| ModelError::Mismatch {
                path: path.to_path_buf(),
                field: format!("metadata 'tokenizer.ggml.merges' #{i}"),
                expected: "two tokens separated by a space".into(),
                got: format!("{m:?}"),
            })?;
            merges.push((a.to_string(), b.to_string()));
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let space_prefix = g
            .opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true);
        let mut plain = match spm {
            true => {
                let scores = match g.get("tokenizer.ggml.scores") {
                    Some(crate::gguf::Value::Array(crate::gguf::Array::F32(v)))
                        if v.len() == tokens.len() =>
                    {
                        v.clone()
                    }
                    _ => {
                        return Err(ModelError::Mismatch {
                            path: path.to_path_buf(),
                            field: "metadata 'tokenizer.ggml.scores'".into(),
                            expected: format!(
                                "{} f32 scores (one per token of a SentencePiece vocabulary)",
                                tokens.len()
                            ),
                            got: g
                                .get("tokenizer.ggml.scores")
                                .map_or("nothing".into(), |v| v.describe()),
                        })
                    }
                };
                sentencepiece(&tokens, &scores, &types, space_prefix, path)?
            }
            false => {
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .ignore_merges(ignore_merges)
                    .build()
                    .map_err(|e| {
                        tk_err(format!("{}: building the BPE model: {e}", path.display()))
                    })?;
                let mut t = tokenizers::Tokenizer::new(bpe);
                t.with_pre_tokenizer(pre_tok);
                t.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
                t
            }
        };
        let mut special_tokens = Vec::new();
        let mut user_tokens = Vec::new();
        let mut special = vec![false; tokens.len()];
        for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
            match *ty {
                token_type::CONTROL | token_type::UNKNOWN => {
                    special[i] = true;
                    special_tokens.push(AddedToken::from(t.to_string(), true));
                }
                token_type::USER_DEFINED => {
                    user_tokens.push(AddedToken::from(t.to_string(), false))
                }
                token_type::NORMAL | token_type::UNUSED | token_type::BYTE => {}
                other => {
                    return Err(ModelError::Mismatch {
                        path: path.to_path_buf(),
                        field: format!("metadata 'tokenizer.ggml.token_type' #{i}"),
                        expected: "a llama_token_type (1..=6)".into(),
                        got: other.to_string(),
                    })
                }
            }
        }
        plain.add_tokens(&user_tokens);
        let mut with_special = plain.clone();
        with_special.add_special_tokens(&special_tokens);
        let bl = byte_level_decoder();
        let byte_mode = match spm {
            true => ByteMode::SentencePiece,
            false => ByteMode::ByteLevel,
        };
        let bytes = tokens
            .iter()
            .zip(&types)
            .map(|(t, ty)| match *ty {
                token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => {
                    t.as_bytes().to_vec()
                }
                _ => token_to_bytes(t, byte_mode, &bl),
            })
            .collect();
        let tk = Tokenizer {
            with_special,
            plain,
            bytes,
            special,
            byte_mode,
            bos,
            eos,
            add_bos,
        };
        tk.check_ids(path)?;
        Ok(tk)
    }

    /// The tokenizer as an HF `tokenizer.json` (special tokens as `added_tokens` marked special):
    /// what `from_hf_json` and HF's `PreTrainedTokenizerFast` read back.
    pub fn to_hf_json(&self) -> Result<String> {
        self.with_special
            .to_string(true)
            .map_err(|e| tk_err(format!("serializing the tokenizer: {e}")))
    }

    /// Build from an HF `tokenizer.json` (its bytes). Special tokens are its `added_tokens` marked
    /// `special`; the post-processor is not used (BOS is added by `encode` when asked).
    pub fn from_hf_json(
        json: &[u8],
        path: &std::path::Path,
        bos: Option<u32>,
        eos: Vec<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        let err = |e: &dyn std::fmt::Display| tk_err(format!("{}: {e}", path.display()));
        let with_special = tokenizers::Tokenizer::from_bytes(json).map_err(|e| err(&e))?;
        let mut v: Json = serde_json::from_slice(json).map_err(|e| err(&e))?;
        if let Some(Json::Array(added)) = v.get_mut("added_tokens") {
            added.retain(|t| t.get("special").and_then(Json::as_bool) != Some(true));
        }
        let plain_json = serde_json::to_vec(&v).map_err(|e| err(&e))?;
        let plain = tokenizers::Tokenizer::from_bytes(plain_json).map_err(|e| err(&e))?;
        let decoder = v.get("decoder").map(|d| d.to_string()).unwrap_or_default();
        let byte_mode = if decoder.contains("\"ByteLevel\"") {
            ByteMode::ByteLevel
        } else if decoder.contains("\"ByteFallback\"") || decoder.contains("\"Metaspace\"") {
            ByteMode::SentencePiece
        } else {
            ByteMode::Raw
        };
        let n = with_special.get_vocab_size(true);
        let added = with_special.get_added_tokens_decoder();
        let bl = byte_level_decoder();
        let mut bytes = Vec::with_capacity(n);
        let mut special = vec![false; n];
        for id in 0..n as u32 {
            if let Some(a) = added.get(&id) {
                special[id as usize] = a.special;
                bytes.push(a.content.as_bytes().to_vec());
            } else {
                let t = with_special.id_to_token(id).unwrap_or_default();
                bytes.push(token_to_bytes(&t, byte_mode, &bl));
            }
        }
        let tk = Tokenizer {
            with_special,
            plain,
            bytes,
            special,
            byte_mode,
            bos,
            eos,
            add_bos,
        };
        tk.check_ids(path)?;
        Ok(tk)
    }

    fn check_ids(&self, path: &std::path::Path) -> Result<()> {
        for id in self.bos.iter().chain(&self.eos) {
            if *id as usize >= self.vocab_size() {
                return Err(ModelError::Mismatch {
                    path: path.to_path_buf(),
                    field: "bos/eos token id".into(),
                    expected: format!("< the tokenizer's vocabulary size {}", self.vocab_size()),
                    got: id.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Token ids of `text`. `add_bos` prepends the BOS id (an error if the model has none);
    /// `parse_special` matches special tokens such as `<|im_start|>` in the text (otherwise their text
    /// is tokenized as ordinary characters).
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>> {
        let tk = if parse_special {
            &self.with_special
        } else {
            &self.plain
        };
        let enc = tk
            .encode_fast(text, false)
            .map_err(|e| tk_err(format!("encoding {} bytes: {e}", text.len())))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos {
            ids.push(
                self.bos
                    .ok_or_else(|| tk_err("add_bos requested but the model has no BOS token"))?,
            );
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`; special tokens are left out when `skip_special`. Invalid UTF-8 (a sequence cut
    /// inside a character) becomes U+FFFD; ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        if self.byte_mode == ByteMode::ByteLevel {
            let mut out = Vec::new();
            for &id in ids {
                if skip_special && self.is_special(id) {
                    continue;
                }
                if let Some(b) = self.bytes.get(id as usize) {
                    out.extend_from_slice(b);
                }
            }
            return String::from_utf8_lossy(&out).into_owned();
        }
        let ids: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < self.bytes.len())
            .collect();
        self.with_special
            .decode(&ids, skip_special)
            .unwrap_or_else(|_| {
                // the tokenizers decoders fail only on ids they do not know, which are filtered above
                String::from_utf8_lossy(
                    &ids.iter()
                        .flat_map(|&id| self.token_bytes(id))
                        .collect::<Vec<u8>>(),
                )
                .into_owned()
            })
    }

    /// The raw bytes token `id` stands for (may be part of a UTF-8 character); empty for an id outside
    /// the vocabulary. Special tokens give their text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.bytes.get(id as usize).cloned().unwrap_or_default()
    }

    /// Same as [`Tokenizer::token_bytes`], borrowed.
    pub fn token_bytes_ref(&self, id: u32) -> &[u8] {
        self.bytes
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The vocabulary entry of `id` as stored (e.g. `Ġthe` in a byte-level vocabulary).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.with_special.id_to_token(id)
    }

    /// The most bytes one token stands for (special tokens count their text): a text of `b` bytes
    /// has at least `b / max_token_bytes()` tokens, which bounds a prompt before it is tokenized.
    pub fn max_token_bytes(&self) -> usize {
        self.bytes.iter().map(Vec::len).max().unwrap_or(0).max(1)
    }

    /// Number of ids (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-generation ids.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Whether prompts start with BOS by default for this model.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The id of a vocabulary entry (as stored, e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.with_special.token_to_id(token)
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet() {
        let m = byte_level_decoder();
        assert_eq!(m.len(), 256);
        let mut bytes: Vec<u8> = m.values().copied().collect();
        bytes.sort();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
        // GPT-2: space is 'Ġ' (U+0120), newline 'Ċ' (U+010A), 'a' is itself
        assert_eq!(m[&'\u{120}'], b' ');
        assert_eq!(m[&'\u{10A}'], b'\n');
        assert_eq!(m[&'a'], b'a');
        assert_eq!(token_to_bytes("Ġhello", ByteMode::ByteLevel, &m), b" hello");
        assert_eq!(token_to_bytes("<0x0A>", ByteMode::SentencePiece, &m), b"\n");
        assert_eq!(
            token_to_bytes("\u{2581}the", ByteMode::SentencePiece, &m),
            b" the"
        );
    }
}
