//! The run's two credentials (docs/security.md): the run token, which the coordinator, trainer
//! and engines hold and which opens every internal endpoint, and the agent credential, which
//! agent pods hold and which opens only what an agent needs on the coordinator (leasing and
//! returning episodes, generating).
//!
//! The agent credential is derived from the run token (HMAC-SHA256 of a fixed label, keyed by
//! the token), so the operator keeps one random secret per run and every holder of the run token
//! can check an agent's credential, while a holder of the agent credential cannot recover the
//! run token from it.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// What the agent credential is the MAC of; a new version of the scheme changes the label.
const AGENT_LABEL: &[u8] = b"moult agent credential v1";

/// The agent credential of the run whose token is `run_token` (64 lowercase hex digits).
pub fn agent_credential(run_token: &str) -> String {
    mac(run_token, &[AGENT_LABEL])
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What a run's pool credential is the MAC of, before the run's name.
const POOL_LABEL: &[u8] = b"moult pool run credential v1\0";

/// The credential run `run` presents to the engines of an `EnginePool` whose token is
/// `pool_token`: `<run>.<64 hex digits>` (docs/lora.md, "Isolation"). The engines check it
/// without a list of runs ([`pool_run`]); a run cannot derive another run's credential, nor the
/// pool token, from its own.
pub fn pool_credential(pool_token: &str, run: &str) -> String {
    let mac = mac(pool_token, &[POOL_LABEL, run.as_bytes()]);
    format!(
        "{run}.{}",
        mac.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// The run a pool credential belongs to, if `credential` is one the pool token made.
pub fn pool_run<'a>(pool_token: &str, credential: &'a str) -> Option<&'a str> {
    let (run, _) = credential.rsplit_once('.')?;
    let expected = pool_credential(pool_token, run);
    let same = expected.len() == credential.len()
        && (expected.bytes().zip(credential.bytes())).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0;
    (same && !run.is_empty()).then_some(run)
}

/// HMAC-SHA256 keyed by the run token (trimmed, as the Secret's value is read) of `parts`
/// concatenated: the agent credential, and the proofs of the weight stream's handshake.
pub fn mac(run_token: &str, parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(run_token.trim().as_bytes())
        .expect("HMAC takes a key of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_credential_is_hmac_sha256_of_the_label() {
        // The construction, computed independently with Python:
        // hmac.new(b"s3cret", b"moult agent credential v1", hashlib.sha256).hexdigest()
        assert_eq!(agent_credential("s3cret"), PYTHON_S3CRET);
        assert_eq!(agent_credential(" s3cret\n"), PYTHON_S3CRET);
        assert_ne!(agent_credential("s3cret2"), PYTHON_S3CRET);
        assert_eq!(agent_credential("s3cret").len(), 64);
    }

    #[test]
    fn a_pool_credential_names_its_run_and_opens_only_it() {
        // hmac.new(b"pool", b"moult pool run credential v1\0" + b"run-a", hashlib.sha256).hexdigest()
        let a = pool_credential("pool", "run-a");
        assert_eq!(a, format!("run-a.{PYTHON_POOL_RUN_A}"));
        assert_eq!(pool_run("pool", &a), Some("run-a"));
        assert_eq!(
            pool_run("pool\n", &a),
            Some("run-a"),
            "the Secret's value is trimmed"
        );
        assert_eq!(pool_run("other", &a), None, "another pool's credential");
        let forged = a.replacen("run-a", "run-b", 1);
        assert_eq!(pool_run("pool", &forged), None, "renamed to another run");
        assert_eq!(pool_run("pool", "run-a"), None);
        assert_eq!(pool_run("pool", &pool_credential("pool", "")), None);
    }

    const PYTHON_POOL_RUN_A: &str =
        "5300ff7d9dfea16150b3c379f7e4ccf1da8fd3b29f49a6de9b1762d8025ba82a";

    const PYTHON_S3CRET: &str = "d478a5f7a6768b33bb0c74befddd46ade50bac8e39aea1faf4b5e86f48677d81";
}
