//! Serving metrics with vLLM's names: gauges, counters and latency histograms, kept by the engine
//! loop and read by anyone through [`crate::EngineHandle::metrics`].
//!
//! Invariants: histogram bucket bounds are fixed (vLLM's) and `counts[i]` counts observations
//! `<= bounds[i]` non-cumulatively; `+Inf` is `count`. `prometheus_text` renders cumulative buckets as
//! the exposition format requires.

use std::fmt::Write;

/// vLLM's buckets for `time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for `inter_token_latency_seconds`.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for `e2e_request_latency_seconds`.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Most buckets a histogram has (vLLM's TTFT list).
pub const MAX_BUCKETS: usize = 22;

/// A histogram: upper bounds, per-bucket (non-cumulative) counts, sum and count of observations.
/// Plain data without heap parts: the engine publishes a copy after every step, and that copy must
/// cost next to nothing against a GPU step of a few hundred microseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    /// `counts[i]`: observations in `(bounds[i-1], bounds[i]]` (only the first `bounds.len()` used).
    counts: [u64; MAX_BUCKETS],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        assert!(bounds.len() <= MAX_BUCKETS, "raise MAX_BUCKETS");
        Histogram {
            bounds,
            counts: [0; MAX_BUCKETS],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations per bucket (non-cumulative), one per bound.
    pub fn counts(&self) -> &[u64] {
        &self.counts[..self.bounds.len()]
    }

    /// Cumulative counts per bound (the Prometheus `_bucket` values, without `+Inf`).
    pub fn cumulative(&self) -> Vec<u64> {
        self.counts()
            .iter()
            .scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            })
            .collect()
    }
}

/// A copy of the engine's metrics at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    pub num_requests_running: usize,
    pub num_requests_waiting: usize,
    /// Fraction (0..=1) of the KV cache's blocks held by running sequences, as vLLM reports it.
    pub kv_cache_usage_perc: f64,
    /// Sequences preempted (their blocks taken back, recomputed later) for want of KV blocks.
    pub num_preemptions_total: u64,
    /// Grammar masks computed on the host (one per constrained token), and the time they took;
    /// exported as `metrale:grammar_masks_total` and `metrale:grammar_mask_seconds_total`.
    pub grammar_masks_total: u64,
    pub grammar_mask_seconds_total: f64,
    /// Engine steps (loop rounds with running sequences), their wall time (the round's intake,
    /// cancellations and admissions, then the step with its outputs queued), and the part of it
    /// inside the backend's calls (the step itself, with the grammar masks it asks for while the
    /// device runs, embeddings, a draft model's steps): the rest is the host's work between steps. Exported as `metrale:engine_steps_total`,
    /// `metrale:engine_step_seconds_total` and `metrale:engine_backend_seconds_total`.
    pub engine_steps_total: u64,
    pub engine_step_seconds_total: f64,
    pub engine_backend_seconds_total: f64,
    /// Speculative decoding: verification steps of one sequence, the tokens they proposed and
    /// those accepted (vLLM's `spec_decode_num_drafts` / `_num_draft_tokens` /
    /// `_num_accepted_tokens`).
    pub spec_decode_num_drafts_total: u64,
    pub spec_decode_num_draft_tokens_total: u64,
    pub spec_decode_num_accepted_tokens_total: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Prompt tokens looked up in the prefix cache, and those found (their KV entries reused).
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
    /// Requests finished, by reason: stop, length, abort (cancelled), error.
    pub request_success_total: [(&'static str, u64); 4],
    pub time_to_first_token_seconds: Histogram,
    pub inter_token_latency_seconds: Histogram,
    pub e2e_request_latency_seconds: Histogram,
}

impl Default for MetricsSnapshot {
    fn default() -> Self {
        MetricsSnapshot {
            num_requests_running: 0,
            num_requests_waiting: 0,
            kv_cache_usage_perc: 0.0,
            num_preemptions_total: 0,
            grammar_masks_total: 0,
            grammar_mask_seconds_total: 0.0,
            engine_steps_total: 0,
            engine_step_seconds_total: 0.0,
            engine_backend_seconds_total: 0.0,
            spec_decode_num_drafts_total: 0,
            spec_decode_num_draft_tokens_total: 0,
            spec_decode_num_accepted_tokens_total: 0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            prefix_cache_queries_total: 0,
            prefix_cache_hits_total: 0,
            request_success_total: [("stop", 0), ("length", 0), ("abort", 0), ("error", 0)],
            time_to_first_token_seconds: Histogram::new(TTFT_BUCKETS),
            inter_token_latency_seconds: Histogram::new(ITL_BUCKETS),
            e2e_request_latency_seconds: Histogram::new(E2E_BUCKETS),
        }
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn fmt_f64(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

impl MetricsSnapshot {
    /// The snapshot in the Prometheus text exposition format (version 0.0.4), every sample labelled
    /// `model_name="<model_name>"`, names as vLLM spells them (`vllm:num_requests_running`, ...).
    pub fn prometheus_text(&self, model_name: &str) -> String {
        let m = escape_label(model_name);
        let mut s = String::new();
        let scalar = |s: &mut String, name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(s, "# HELP vllm:{name} {help}");
            let _ = writeln!(s, "# TYPE vllm:{name} {kind}");
            let _ = writeln!(s, "vllm:{name}{{model_name=\"{m}\"}} {v}");
        };
        scalar(
            &mut s,
            "num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            self.num_requests_running.to_string(),
        );
        scalar(
            &mut s,
            "num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            self.num_requests_waiting.to_string(),
        );
        scalar(
            &mut s,
            "kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            fmt_f64(self.kv_cache_usage_perc),
        );
        scalar(
            &mut s,
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            self.prompt_tokens_total.to_string(),
        );
        scalar(
            &mut s,
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            self.generation_tokens_total.to_string(),
        );
        scalar(
            &mut s,
            "prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_cache_queries_total.to_string(),
        );
        scalar(
            &mut s,
            "prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_cache_hits_total.to_string(),
        );
        for (name, help, v) in [
            (
                "spec_decode_num_drafts_total",
                "Number of spec decoding drafts.",
                self.spec_decode_num_drafts_total,
            ),
            (
                "spec_decode_num_draft_tokens_total",
                "Number of draft tokens.",
                self.spec_decode_num_draft_tokens_total,
            ),
            (
                "spec_decode_num_accepted_tokens_total",
                "Number of accepted tokens.",
                self.spec_decode_num_accepted_tokens_total,
            ),
        ] {
            scalar(&mut s, name, "counter", help, v.to_string());
        }
        scalar(
            &mut s,
            "num_preemptions_total",
            "counter",
            "Cumulative number of preemptions from the engine.",
            self.num_preemptions_total.to_string(),
        );
        // not vLLM's: what constrained decoding costs the host (the masks are computed while the
        // device runs the step, so this is time hidden or not, not time added)
        for (name, help, v) in [
            (
                "grammar_masks_total",
                "Grammar masks computed on the host, one per constrained token.",
                self.grammar_masks_total.to_string(),
            ),
            (
                "grammar_mask_seconds_total",
                "Host time spent computing grammar masks, in seconds.",
                fmt_f64(self.grammar_mask_seconds_total),
            ),
            (
                "engine_steps_total",
                "Engine steps run (loop rounds with running sequences).",
                self.engine_steps_total.to_string(),
            ),
            (
                "engine_step_seconds_total",
                "Wall time of the engine's rounds that ran a step, intake to outputs queued, in seconds.",
                fmt_f64(self.engine_step_seconds_total),
            ),
            (
                "engine_backend_seconds_total",
                "The part of the steps' time inside the backend's calls, in seconds.",
                fmt_f64(self.engine_backend_seconds_total),
            ),
        ] {
            let _ = writeln!(s, "# HELP metrale:{name} {help}");
            let _ = writeln!(s, "# TYPE metrale:{name} counter");
            let _ = writeln!(s, "metrale:{name}{{model_name=\"{m}\"}} {v}");
        }
        let _ = writeln!(
            s,
            "# HELP vllm:request_success_total Count of successfully processed requests."
        );
        let _ = writeln!(s, "# TYPE vllm:request_success_total counter");
        for (reason, n) in &self.request_success_total {
            let _ = writeln!(
                s,
                "vllm:request_success_total{{finished_reason=\"{reason}\",model_name=\"{m}\"}} {n}"
            );
        }
        for (name, help, h) in [
            (
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &self.time_to_first_token_seconds,
            ),
            (
                "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &self.inter_token_latency_seconds,
            ),
            (
                "e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                &self.e2e_request_latency_seconds,
            ),
        ] {
            let _ = writeln!(s, "# HELP vllm:{name} {help}");
            let _ = writeln!(s, "# TYPE vllm:{name} histogram");
            for (b, c) in h.bounds.iter().zip(h.cumulative()) {
                let _ = writeln!(
                    s,
                    "vllm:{name}_bucket{{le=\"{}\",model_name=\"{m}\"}} {c}",
                    fmt_f64(*b)
                );
            }
            let _ = writeln!(
                s,
                "vllm:{name}_bucket{{le=\"+Inf\",model_name=\"{m}\"}} {}",
                h.count
            );
            let _ = writeln!(
                s,
                "vllm:{name}_sum{{model_name=\"{m}\"}} {}",
                fmt_f64(h.sum)
            );
            let _ = writeln!(s, "vllm:{name}_count{{model_name=\"{m}\"}} {}", h.count);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_le_and_cumulative_in_text() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 3.0] {
            h.observe(v);
        }
        assert_eq!(h.counts(), [2, 1]);
        assert_eq!(h.cumulative(), vec![2, 3]);
        assert_eq!(h.count, 4);
        assert!((h.sum - 3.65).abs() < 1e-12);
        let mut s = MetricsSnapshot {
            num_requests_running: 2,
            prompt_tokens_total: 17,
            ..Default::default()
        };
        s.time_to_first_token_seconds = h;
        let text = s.prometheus_text("smol\"lm");
        assert!(text.contains("vllm:num_requests_running{model_name=\"smol\\\"lm\"} 2\n"));
        assert!(text.contains("# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name=\"smol\\\"lm\"} 17\n"));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{le=\"1\",model_name=\"smol\\\"lm\"} 3\n"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"smol\\\"lm\"} 4\n"
        ));
        assert!(
            text.contains("vllm:time_to_first_token_seconds_count{model_name=\"smol\\\"lm\"} 4\n")
        );
        assert!(text.contains("# TYPE vllm:e2e_request_latency_seconds histogram\n"));
    }
}
