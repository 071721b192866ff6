//! What an agent knows of the job: the generation, where its copies go (its buddy) and whose
//! copies it keeps (its wards); the line a supervisor sends it.

use ckpt_store::{Error, Result};

/// What an agent knows of the job, from its own launch configuration and the job's plans
/// (never from a client's frame).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// The job's current generation: snapshots of later generations are refused (`None`: not
    /// known yet; every authenticated client's generation is taken).
    pub generation: Option<u64>,
    /// Where copies of this node's snapshots go (`None`: nowhere).
    pub buddy: Option<String>,
    /// The nodes whose copies this agent keeps (`None`: any other node's).
    pub wards: Option<Vec<u32>>,
}

impl Membership {
    /// Node `node`'s view of generation `generation` with these live agents ((node, address),
    /// in node order): its buddy is the next live node's agent (wrapping around), its ward the
    /// previous one's node; alone, neither.
    pub fn of(node: u32, generation: u64, agents: &[(u32, String)]) -> Membership {
        let mut m = Membership {
            generation: Some(generation),
            buddy: None,
            wards: Some(Vec::new()),
        };
        if let Some(i) = agents.iter().position(|(n, _)| *n == node)
            && agents.len() > 1
        {
            let n = agents.len();
            m.buddy = Some(agents[(i + 1) % n].1.clone());
            m.wards = Some(vec![agents[(i + n - 1) % n].0]);
        }
        m
    }

    /// The line a supervisor writes to an agent's standard input when a generation starts:
    /// `members GEN NODE=ADDR,NODE=ADDR,...` (the live agents in node order).
    pub fn line(generation: u64, agents: &[(u32, String)]) -> String {
        let list: Vec<String> = agents.iter().map(|(n, a)| format!("{n}={a}")).collect();
        format!("members {generation} {}\n", list.join(","))
    }

    /// Parse a [`Membership::line`] for node `node`.
    pub fn parse_line(node: u32, line: &str) -> Result<Membership> {
        let bad = |why: &str| {
            Error::invalid(format!(
                "membership line {:?}: {why} (want `members GEN NODE=ADDR,...`)",
                line.trim()
            ))
        };
        let mut it = line.split_whitespace();
        if it.next() != Some("members") {
            return Err(bad("it does not start with `members`"));
        }
        let generation: u64 = it
            .next()
            .ok_or_else(|| bad("no generation"))?
            .parse()
            .map_err(|_| bad("the generation is not a number"))?;
        let mut agents = Vec::new();
        for item in it.next().unwrap_or("").split(',').filter(|s| !s.is_empty()) {
            let (n, a) = item
                .split_once('=')
                .ok_or_else(|| bad("an agent is not NODE=ADDR"))?;
            let n: u32 = n.parse().map_err(|_| bad("a node is not a number"))?;
            agents.push((n, a.to_string()));
        }
        if it.next().is_some() {
            return Err(bad("more than three fields"));
        }
        agents.sort();
        Ok(Membership::of(node, generation, &agents))
    }
}
