//! `moult trainer-rank`: a trainer rank after the first (started by rank 0 with the
//! MOULT_TRAINER_* variables set): joins, follows rank 0, exits when it says stop, or fails
//! when it is lost (docs/distributed.md).

#[derive(Debug, clap::Args)]
pub struct Args {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[cfg(feature = "torch")]
pub fn run(args: Args) -> anyhow::Result<()> {
    use anyhow::Context;
    use moult_runtime::dist::Rendezvous;
    use moult_runtime::trainer::ranks;
    // Started by a rank 0 on this machine: go when it goes.
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    let device = super::device(Some(args.device.as_str()), false)?;
    let rendezvous = Rendezvous::from_env()?
        .context("MOULT_TRAINER_WORLD_SIZE must be above 1 for a trainer rank")?;
    let group = moult_runtime::cluster::trainer::join(&rendezvous, device)?;
    let rank = group.rank();
    let mut trainer = ranks::follower(group, device)
        .with_context(|| format!("trainer rank {rank}: joining rank 0"))?;
    trainer
        .follow()
        .with_context(|| format!("trainer rank {rank}"))?;
    Ok(())
}
