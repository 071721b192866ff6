//! Which generation of the run this job is ([`choose_generation`]).

use ckpt_store::{Result, Store};

use crate::TrainArgs;

/// This job's generation. Set (`--generation`, `CKPT_GENERATION` from a supervisor): every
/// rank joins it. All ranks in this process: a new generation claimed in the store (above
/// every started one and every one that saved), so this job fences any older job of the run,
/// and two jobs started at once get different numbers. One rank per process without a
/// supervisor: the ranks cannot agree on a fresh number without talking, so each takes the
/// larger of what the saved steps call for and the newest started generation (the one a
/// sibling rank of this job may have just marked); pass `--generation` to be explicit.
/// With a local tier, the generations that saved there count too (its steps may not have
/// reached the store yet).
pub(crate) async fn choose_generation(
    store: &Store,
    local: Option<&Store>,
    args: &TrainArgs,
) -> Result<u64> {
    if let Some(g) = args.generation {
        return Ok(g);
    }
    let resume = args.resume || args.resume_step.is_some();
    let mut floor = if resume {
        next_generation(store, &args.run).await?
    } else {
        0
    };
    if let (true, Some(l)) = (resume, local) {
        floor = floor.max(next_generation(l, &args.run).await?).max(
            l.log()
                .newest_generation(&args.run)
                .await?
                .map_or(0, |g| g + 1),
        );
    }
    if args.rank.is_none() {
        return store.log().claim_generation(&args.run, floor).await;
    }
    if !resume {
        return Ok(floor);
    }
    Ok(floor.max(store.log().newest_generation(&args.run).await?.unwrap_or(0)))
}

/// One more than any generation that saved in `run`: the newest commit's, and those of
/// manifests left by attempts that died before committing.
async fn next_generation(store: &Store, run: &str) -> Result<u64> {
    let mut g = 0;
    let latest = store.log().latest_committed(run).await?;
    if let Some(s) = latest {
        g = store.log().read_commit_root(run, s).await?.0.generation + 1;
    }
    for st in store.log().list_steps(run).await? {
        if st.committed || latest.is_some_and(|l| st.step < l) {
            continue;
        }
        for r in st.ranks {
            if let Ok((m, _, _)) = store.log().get_rank_manifest(run, st.step, r).await {
                g = g.max(m.generation + 1);
            }
        }
    }
    Ok(g)
}
