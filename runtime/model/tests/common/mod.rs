//! A small GGUF writer for tests: builds synthetic llama files (valid, or broken on purpose).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub enum V {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArr(Vec<String>),
    I32Arr(Vec<i32>),
}

pub struct T {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    /// Override the offset written in the tensor info.
    pub offset: Option<u64>,
}

pub struct Gguf {
    pub version: u32,
    pub kvs: Vec<(String, V)>,
    pub tensors: Vec<T>,
    pub alignment: u64,
}

fn s(out: &mut Vec<u8>, x: &str) {
    out.extend((x.len() as u64).to_le_bytes());
    out.extend(x.as_bytes());
}

impl Gguf {
    pub fn kv(&mut self, k: &str, v: V) -> &mut Self {
        self.kvs.retain(|(kk, _)| kk != k);
        self.kvs.push((k.into(), v));
        self
    }

    pub fn remove_kv(&mut self, k: &str) -> &mut Self {
        self.kvs.retain(|(kk, _)| kk != k);
        self
    }

    pub fn tensor(&mut self, name: &str) -> &mut T {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect("tensor in the synthetic model")
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut o = Vec::new();
        o.extend(b"GGUF");
        o.extend(self.version.to_le_bytes());
        o.extend((self.tensors.len() as u64).to_le_bytes());
        o.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            s(&mut o, k);
            match v {
                V::U32(x) => {
                    o.extend(4u32.to_le_bytes());
                    o.extend(x.to_le_bytes())
                }
                V::I32(x) => {
                    o.extend(5u32.to_le_bytes());
                    o.extend(x.to_le_bytes())
                }
                V::F32(x) => {
                    o.extend(6u32.to_le_bytes());
                    o.extend(x.to_le_bytes())
                }
                V::Bool(x) => {
                    o.extend(7u32.to_le_bytes());
                    o.push(*x as u8)
                }
                V::Str(x) => {
                    o.extend(8u32.to_le_bytes());
                    s(&mut o, x)
                }
                V::StrArr(xs) => {
                    o.extend(9u32.to_le_bytes());
                    o.extend(8u32.to_le_bytes());
                    o.extend((xs.len() as u64).to_le_bytes());
                    for x in xs {
                        s(&mut o, x)
                    }
                }
                V::I32Arr(xs) => {
                    o.extend(9u32.to_le_bytes());
                    o.extend(5u32.to_le_bytes());
                    o.extend((xs.len() as u64).to_le_bytes());
                    for x in xs {
                        o.extend(x.to_le_bytes())
                    }
                }
            }
        }
        let mut off = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            s(&mut o, &t.name);
            o.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                o.extend(d.to_le_bytes());
            }
            o.extend(t.ggml_type.to_le_bytes());
            o.extend(t.offset.unwrap_or(off).to_le_bytes());
            offsets.push(off);
            off += (t.data.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        while !(o.len() as u64).is_multiple_of(self.alignment) {
            o.push(0);
        }
        let base = o.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            o.resize(base + off as usize, 0);
            o.extend(&t.data);
        }
        o
    }

    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.bytes()).unwrap();
        p
    }
}

pub const HIDDEN: usize = 64;
pub const HEADS: usize = 2;
pub const KV_HEADS: usize = 1;
pub const HEAD_DIM: usize = 32;
pub const FFN: usize = 128;
pub const LAYERS: usize = 2;

/// GPT-2's byte -> printable char map.
pub fn byte_char(b: u8) -> char {
    let b = b as u32;
    let printable =
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    if printable {
        return char::from_u32(b).unwrap();
    }
    let mut n = 0;
    for x in 0..b {
        let p =
            (0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || (0xae..=0xff).contains(&x);
        if !p {
            n += 1;
        }
    }
    char::from_u32(256 + n).unwrap()
}

/// Vocabulary: 3 control tokens, 256 byte tokens, then merged tokens.
pub fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3, 3, 3];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(1);
    }
    let merges: Vec<String> = ["h e", "l l", "he ll", "hell o", "1 2", "12 3", "Ġ h"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types, merges)
}

fn det_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn f32_ones(n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect()
}

/// A valid tiny llama GGUF: 2 layers, hidden 64, 2 heads of 32, 1 KV head, FFN 128, Q4_1 matrices,
/// Q8_0 token_embd, F32 norms, tied LM head, smollm pre-tokenizer.
pub fn tiny_llama() -> Gguf {
    let (tokens, types, merges) = vocab();
    let vocab = tokens.len();
    let mut g = Gguf {
        version: 3,
        kvs: vec![],
        tensors: vec![],
        alignment: 32,
    };
    g.kv("general.architecture", V::Str("llama".into()))
        .kv("general.name", V::Str("tiny".into()))
        .kv("llama.block_count", V::U32(LAYERS as u32))
        .kv("llama.embedding_length", V::U32(HIDDEN as u32))
        .kv("llama.attention.head_count", V::U32(HEADS as u32))
        .kv("llama.attention.head_count_kv", V::U32(KV_HEADS as u32))
        .kv("llama.feed_forward_length", V::U32(FFN as u32))
        .kv("llama.context_length", V::U32(256))
        .kv("llama.rope.freq_base", V::F32(100000.0))
        .kv("llama.rope.dimension_count", V::U32(HEAD_DIM as u32))
        .kv("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5))
        .kv("tokenizer.ggml.model", V::Str("gpt2".into()))
        .kv("tokenizer.ggml.pre", V::Str("smollm".into()))
        .kv("tokenizer.ggml.tokens", V::StrArr(tokens))
        .kv("tokenizer.ggml.token_type", V::I32Arr(types))
        .kv("tokenizer.ggml.merges", V::StrArr(merges))
        .kv("tokenizer.ggml.bos_token_id", V::U32(1))
        .kv("tokenizer.ggml.eos_token_id", V::U32(2))
        .kv("tokenizer.ggml.add_bos_token", V::Bool(false))
        .kv(
            "tokenizer.chat_template",
            V::Str("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into()),
        );
    let mut seed = 1;
    let mut q = |name: &str, inp: usize, out: usize, ty: u32| {
        seed += 1;
        let block = if ty == 3 { 20 } else { 34 };
        T {
            name: name.into(),
            dims: vec![inp as u64, out as u64],
            ggml_type: ty,
            data: det_bytes(inp / 32 * block * out, seed),
            offset: None,
        }
    };
    let norm = |name: &str| T {
        name: name.into(),
        dims: vec![HIDDEN as u64],
        ggml_type: 0,
        data: f32_ones(HIDDEN),
        offset: None,
    };
    g.tensors.push(q("token_embd.weight", HIDDEN, vocab, 8));
    g.tensors.push(norm("output_norm.weight"));
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        g.tensors.push(norm(&n("attn_norm")));
        g.tensors.push(q(&n("attn_q"), HIDDEN, HEADS * HEAD_DIM, 3));
        g.tensors
            .push(q(&n("attn_k"), HIDDEN, KV_HEADS * HEAD_DIM, 3));
        g.tensors
            .push(q(&n("attn_v"), HIDDEN, KV_HEADS * HEAD_DIM, 3));
        g.tensors
            .push(q(&n("attn_output"), HEADS * HEAD_DIM, HIDDEN, 3));
        g.tensors.push(norm(&n("ffn_norm")));
        g.tensors.push(q(&n("ffn_gate"), HIDDEN, FFN, 3));
        g.tensors.push(q(&n("ffn_up"), HIDDEN, FFN, 3));
        g.tensors.push(q(&n("ffn_down"), FFN, HIDDEN, 3));
    }
    g
}
