//! Sampling: the parameters of one request and the host reference sampler every backend must match.
//! TODO(cpu-engine): implement; this file fixes the parameter struct only.

/// How to choose the next token. Defaults are "no effect" values; `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize, // 0 = off
    pub top_p: f32,   // 1.0 = off
    pub min_p: f32,   // 0.0 = off
    pub repetition_penalty: f32, // 1.0 = off (llama.cpp / HF semantics)
    pub presence_penalty: f32,   // 0.0 = off (OpenAI semantics)
    pub frequency_penalty: f32,  // 0.0 = off (OpenAI semantics)
    pub seed: u64,
    /// How many top logprobs to return per token (0 = none).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
        }
    }
}
