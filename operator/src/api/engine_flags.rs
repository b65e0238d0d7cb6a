//! The engine flags moult sets itself, and the CEL rules that keep `engines.extraArgs` from
//! setting them again (docs/vllm.md). vLLM's parser takes a flag in several spellings: as it is,
//! `--flag=value`, with underscores (`--served_model_name`), as a JSON sub-key (`--flag.key`), and
//! abbreviated to any unique prefix (argparse's `allow_abbrev`: `--served-model`, `-t` for
//! `-tp`); every one of them is refused.

/// Flags of the engine command line that moult sets itself (`children::vllm_args`, and `moult
/// engine`'s `--model`, `--host`, `--port`).
pub const RESERVED_ENGINE_FLAGS: &[&str] = &[
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--tensor-parallel-size",
    "-tp",
    "--logprobs-mode",
    "--enable-scale-out",
    "--weight-transfer-config",
    "--max-model-len",
    "--enable-return-routed-experts",
    // `moult engine`'s adapter of a LoRA run (docs/lora.md).
    "--lora",
    // An EnginePool's engines: the adapters they hold and their largest rank.
    "--pool-max-adapters",
    "--max-lora-rank",
];

/// The flag part of an extra argument `a`, as vLLM's parser reads it: before `=value` and a
/// JSON sub-key's `.key`, with `_` spelled `-`.
const FLAG_PART: &str = "a.split('=')[0].split('.')[0].replace('_', '-')";

/// Whether a flag part `p` names a reserved flag or abbreviates one: at least one character after
/// its dashes, and a prefix of a reserved flag.
fn abbreviates(p: &str) -> String {
    let flags: Vec<String> = RESERVED_ENGINE_FLAGS
        .iter()
        .map(|f| format!("'{f}'"))
        .collect();
    format!(
        "size({p}) > ({p}.startsWith('--') ? 2 : 1) && [{}].exists(f, f.startsWith({p}))",
        flags.join(", ")
    )
}

/// The CEL rule refusing [`RESERVED_ENGINE_FLAGS`], their spellings and abbreviations in
/// `engines.extraArgs`. (The flag part is cut with `split` rather than matched with a regular
/// expression of every prefix: the API server's cost estimate of such a regex over 128 arguments
/// of 2048 characters exceeds its budget.)
pub(crate) fn reserved_flags_rule() -> String {
    format!(
        "!has(self.extraArgs) || !self.extraArgs.map(a, {FLAG_PART}).exists(p, {})",
        abbreviates("p")
    )
}

/// The message of [`reserved_flags_rule`], naming the flag the first refused argument sets.
pub(crate) fn reserved_flags_message() -> String {
    let flags: Vec<String> = RESERVED_ENGINE_FLAGS
        .iter()
        .map(|f| format!("'{f}'"))
        .collect();
    format!(
        "'engines.extraArgs cannot set a flag moult sets itself: ' + [{}].filter(f, f.startsWith(self.extraArgs.map(a, {FLAG_PART}).filter(p, {})[0]))[0] + ' (nor abbreviate or respell it); use engines.tensorParallelSize, model.maxModelLen, routingReplay or engines.weightTransfer instead (docs/vllm.md)'",
        flags.join(", "),
        abbreviates("p")
    )
}

/// The CEL rule on vLLM's `--dtype` among `engines.extraArgs` (both `--dtype X` and
/// `--dtype=X`): only the dtypes the trainer can send weights in.
pub(crate) const ENGINE_DTYPE_RULE: &str = "self.backend != 'vLLM' || !has(self.extraArgs) || (!self.extraArgs.exists(a, a.startsWith('--dtype=') && !a.matches('^--dtype=(auto|float32|float|bfloat16|float16|half)$')) && (!('--dtype' in self.extraArgs) || (self.extraArgs.indexOf('--dtype') + 1 < size(self.extraArgs) && self.extraArgs[self.extraArgs.indexOf('--dtype') + 1] in ['auto', 'float32', 'float', 'bfloat16', 'float16', 'half'])))";
