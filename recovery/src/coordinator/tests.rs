//! The coordinator's own cases (the decision tables are in `recovery/tests/decisions.rs`).

use super::*;
use ckpt_store::MismatchPolicy;

fn cfg(nodes: u32, spares: u32, layout: &str) -> Config {
    let mut c = Config::new(
        Topology {
            nodes,
            ranks_per_node: 1,
            spares,
        },
        layout.parse().unwrap(),
    );
    c.stop_grace = Duration::from_millis(500);
    c.backoff = Duration::from_millis(100);
    c
}

fn inherited(layout: &str, nodes: &[u32]) -> TakeOver {
    TakeOver {
        generation: 5,
        layout: layout.parse().unwrap(),
        assignments: nodes
            .iter()
            .enumerate()
            .map(|(r, &node)| Assignment {
                rank: r as u32,
                node,
                local_rank: 0,
            })
            .collect(),
        excluded: BTreeSet::new(),
        restarts: 1,
        max_step: 12,
        stopping: false,
        killed: false,
        exited: BTreeMap::new(),
        lost_nodes: BTreeMap::new(),
    }
}

fn ms(t: u64) -> Duration {
    Duration::from_millis(t)
}

#[test]
fn the_lost_coordinators_node_is_failed_and_the_job_restarts_without_it() {
    let mut t = inherited("dp=3", &[0, 1, 2]);
    t.lost_nodes.insert(1, "it ran the coordinator".into());
    let (mut c, out) = Coordinator::take_over(cfg(3, 0, "dp=3"), t, ms(0));
    assert!(matches!(
        &out[0],
        Action::Record(Record::Failure(records::Failure { generation: 5, rank: 1, node: 1, how, .. })) if how == "node"
    ));
    assert_eq!(
        out[1],
        Action::Signal {
            generation: 5,
            ranks: vec![0, 2],
            kill: false
        }
    );
    assert_eq!(out.len(), 2);
    assert!(
        c.on_event(Event::Exited {
            generation: 5,
            rank: 0,
            status: ExitStatus::Signal(15),
            now: ms(10)
        })
        .is_empty()
    );
    let out = c.on_event(Event::Exited {
        generation: 5,
        rank: 2,
        status: ExitStatus::Signal(15),
        now: ms(20),
    });
    assert_eq!(
        out,
        vec![Action::ChooseStep {
            generation: 5,
            skip: vec![],
            below: None
        }]
    );
    let out = c.on_event(Event::StepChosen {
        generation: 5,
        step: Some(8),
        damaged: vec![],
        now: ms(30),
    });
    assert!(matches!(
        &out[0],
        Action::Record(Record::Recovery(records::Recovery { layout, step: Some(8), steps_lost: 4, .. }))
            if layout == "dp=2,tp=1,pp=1"
    ));
    assert_eq!(c.restarts(), 2);
    let out = c.on_event(Event::Tick { now: ms(300) });
    assert!(matches!(
        &out[1],
        Action::Start { generation: 6, assignments, resume_from: Some(8), .. }
            if assignments.iter().map(|a| a.node).collect::<Vec<_>>() == [0, 2]
    ));
    assert_eq!(c.excluded(), vec![1]);
}

#[test]
fn a_coordinator_lost_on_a_node_without_ranks_changes_nothing() {
    let mut t = inherited("dp=2", &[0, 1]);
    t.lost_nodes.insert(2, "it ran the coordinator".into());
    let (mut c, out) = Coordinator::take_over(cfg(2, 1, "dp=2"), t, ms(0));
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(c.excluded(), vec![2]);
    assert_eq!(c.live_ranks(), vec![0, 1]);
    // The ranks carry on and finish under the new coordinator.
    for r in 0..2 {
        let out = c.on_event(Event::Exited {
            generation: 5,
            rank: r,
            status: ExitStatus::Code(0),
            now: ms(100),
        });
        if r == 1 {
            assert_eq!(
                out.last(),
                Some(&Action::Done {
                    ok: true,
                    reason: "every rank finished".into()
                })
            );
        }
    }
}

#[test]
fn stopping_goes_on_where_the_previous_coordinator_left_it() {
    // It had sent SIGKILL: exits with signal 9 are not new failures.
    let mut t = inherited("dp=3", &[0, 1, 2]);
    t.stopping = true;
    t.killed = true;
    t.excluded.insert(2);
    t.exited.insert(2, ExitStatus::Signal(9));
    let (mut c, out) = Coordinator::take_over(cfg(3, 0, "dp=3"), t, ms(0));
    assert_eq!(
        out,
        vec![Action::Signal {
            generation: 5,
            ranks: vec![0, 1],
            kill: true
        }]
    );
    assert!(
        c.on_event(Event::Exited {
            generation: 5,
            rank: 0,
            status: ExitStatus::Signal(9),
            now: ms(5)
        })
        .is_empty()
    );
    let out = c.on_event(Event::Exited {
        generation: 5,
        rank: 1,
        status: ExitStatus::Signal(9),
        now: ms(6),
    });
    assert_eq!(
        out,
        vec![Action::ChooseStep {
            generation: 5,
            skip: vec![],
            below: None
        }]
    );
    assert_eq!(c.excluded(), vec![2]);
}

#[test]
fn an_unrecorded_abnormal_exit_is_a_failure_and_a_finished_job_is_done() {
    let mut t = inherited("dp=2", &[0, 1]);
    t.exited.insert(1, ExitStatus::Code(3));
    let (_, out) = Coordinator::take_over(cfg(2, 1, "dp=2"), t, ms(0));
    assert!(matches!(
        &out[0],
        Action::Record(Record::Failure(records::Failure { rank: 1, node: 1, how, .. })) if how == "exit"
    ));
    let mut t = inherited("dp=2", &[0, 1]);
    t.exited.insert(0, ExitStatus::Code(0));
    t.exited.insert(1, ExitStatus::Code(0));
    let (c, out) = Coordinator::take_over(cfg(2, 0, "dp=2"), t, ms(0));
    assert!(c.is_done());
    assert_eq!(
        out.last(),
        Some(&Action::Done {
            ok: true,
            reason: "every rank finished".into()
        })
    );
}

/// The first generation, started from `step`.
fn started(c: &mut Coordinator, step: Option<u64>) -> Vec<Action> {
    assert_eq!(
        c.on_event(Event::Start { now: ms(0) }),
        vec![Action::ChooseStep {
            generation: 0,
            skip: vec![],
            below: None
        }]
    );
    c.on_event(Event::StepChosen {
        generation: 0,
        step,
        damaged: vec![],
        now: ms(0),
    })
}

/// `rank` of the running generation is killed at `now` (ms), the others stop, `step` is
/// chosen: every action until the next generation starts (after its backoff).
fn killed(c: &mut Coordinator, rank: u32, step: Option<u64>, now: u64) -> Vec<Action> {
    let g = c.generation();
    let mut out = c.on_event(Event::Exited {
        generation: g,
        rank,
        status: ExitStatus::Signal(9),
        now: ms(now),
    });
    for r in c.live_ranks() {
        out.extend(c.on_event(Event::Exited {
            generation: g,
            rank: r,
            status: ExitStatus::Signal(15),
            now: ms(now + 10),
        }));
    }
    out.extend(c.on_event(Event::StepChosen {
        generation: g,
        step,
        damaged: vec![],
        now: ms(now + 20),
    }));
    let mut t = now + 20;
    while c.generation() == g && !c.is_done() {
        t += 50;
        out.extend(c.on_event(Event::Tick { now: ms(t) }));
    }
    out
}

/// The nodes of the generation an action list starts.
fn started_on(out: &[Action]) -> Option<(Layout, Vec<u32>, Option<u64>)> {
    out.iter().find_map(|a| match a {
        Action::Start {
            layout,
            assignments,
            resume_from,
            ..
        } => Some((
            *layout,
            assignments.iter().map(|a| a.node).collect(),
            *resume_from,
        )),
        _ => None,
    })
}

fn kept_out_records(out: &[Action]) -> Vec<&records::NodeKeptOut> {
    out.iter()
        .filter_map(|a| match a {
            Action::Record(Record::NodeKeptOut(k)) => Some(k),
            _ => None,
        })
        .collect()
}

fn committed(c: &mut Coordinator, step: u64, now: u64) -> Vec<Action> {
    c.on_event(Event::Committed {
        generation: c.generation(),
        step: Some(step),
        now: ms(now),
    })
}

/// Node `node` comes back at `now` and the job grows at the next commit (`step`, after a
/// first answer of `step - 1`): the actions of the grow.
fn back_and_grown(c: &mut Coordinator, node: u32, step: u64, now: u64) -> Vec<Action> {
    c.on_event(Event::NodeBack { node, now: ms(now) });
    assert_eq!(c.watching_commits(), Some(c.generation()));
    assert!(committed(c, step - 1, now + 10).is_empty());
    let g = c.generation();
    let mut out = committed(c, step, now + 20);
    for r in c.live_ranks() {
        out.extend(c.on_event(Event::Exited {
            generation: g,
            rank: r,
            status: ExitStatus::Signal(15),
            now: ms(now + 30),
        }));
    }
    out.extend(c.on_event(Event::StepChosen {
        generation: g,
        step: Some(step),
        damaged: vec![],
        now: ms(now + 40),
    }));
    assert_eq!(c.generation(), g + 1, "{out:?}");
    out
}

#[test]
fn a_repaired_node_grows_the_job_back_at_the_next_commit_not_before_and_not_mid_save() {
    let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
    started(&mut c, None);
    let out = killed(&mut c, 1, Some(4), 1_000);
    assert_eq!(
        started_on(&out),
        Some(("dp=1".parse().unwrap(), vec![0], Some(4)))
    );
    assert_eq!(c.watching_commits(), None, "nothing to grow onto");
    assert_eq!(c.restarts(), 1);
    let out = c.on_event(Event::Heartbeat {
        generation: 1,
        rank: 0,
        step: 5,
        now: ms(2_000),
    });
    assert!(matches!(&out[..], [Action::Record(Record::Resumed(_))]));
    // Node 1 is repaired at 3 s.
    let out = c.on_event(Event::NodeBack {
        node: 1,
        now: ms(3_000),
    });
    assert_eq!(
        out,
        vec![Action::Record(Record::NodeReturned(
            records::NodeReturned {
                node: 1,
                usable: true,
                at_ms: 3_000
            }
        ))]
    );
    assert_eq!(c.excluded(), Vec::<u32>::new());
    assert_eq!(c.watching_commits(), Some(1));
    // Steps go on; the driver's first answer is where things stand (step 4): no grow.
    let mut t = 3_000;
    for step in 6..=8 {
        t += 50;
        assert!(
            c.on_event(Event::Heartbeat {
                generation: 1,
                rank: 0,
                step,
                now: ms(t)
            })
            .is_empty()
        );
        assert!(c.on_event(Event::Tick { now: ms(t) }).is_empty());
        if step == 6 {
            assert!(committed(&mut c, 4, t).is_empty(), "grew at an old commit");
        }
    }
    // Step 8 is done and being saved, but not committed: nothing yet.
    assert!(committed(&mut c, 4, t + 10).is_empty(), "grew mid-save");
    assert!(c.on_event(Event::Tick { now: ms(t + 20) }).is_empty());
    // A commit seen for an older generation is not this one's.
    assert!(
        c.on_event(Event::Committed {
            generation: 0,
            step: Some(8),
            now: ms(t + 30)
        })
        .is_empty()
    );
    // Step 8 committed: stop the ranks.
    let out = committed(&mut c, 8, t + 40);
    assert_eq!(
        out,
        vec![Action::Signal {
            generation: 1,
            ranks: vec![0],
            kill: false
        }]
    );
    assert_eq!(c.watching_commits(), None);
    // Further commit answers while stopping change nothing.
    assert!(committed(&mut c, 12, t + 45).is_empty());
    let out = c.on_event(Event::Exited {
        generation: 1,
        rank: 0,
        status: ExitStatus::Signal(15),
        now: ms(t + 50),
    });
    assert_eq!(
        out,
        vec![Action::ChooseStep {
            generation: 1,
            skip: vec![],
            below: None
        }]
    );
    // The step just committed is chosen, and the job restarts at once on both nodes.
    let out = c.on_event(Event::StepChosen {
        generation: 1,
        step: Some(8),
        damaged: vec![],
        now: ms(t + 60),
    });
    let Action::Record(Record::Grow(g)) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(
        (
            g.generation,
            g.from_layout.as_str(),
            g.layout.as_str(),
            &g.nodes[..],
            &g.returned[..],
            g.step,
            g.steps_lost
        ),
        (
            1,
            "dp=1,tp=1,pp=1",
            "dp=2,tp=1,pp=1",
            &[0, 1][..],
            &[1][..],
            Some(8),
            0
        )
    );
    assert!(g.reason.contains("came back"), "{}", g.reason);
    assert_eq!(
        started_on(&out),
        Some(("dp=2".parse().unwrap(), vec![0, 1], Some(8)))
    );
    assert_eq!(c.generation(), 2);
    assert!(
        !out.iter()
            .any(|a| matches!(a, Action::Record(Record::Recovery(_)))),
        "a grow is not a recovery: {out:?}"
    );
    // A grow is not a restart (no backoff, no budget spent), and there is nothing more to
    // grow onto.
    assert_eq!(c.restarts(), 1);
    assert_eq!(c.watching_commits(), None);
    let out = c.on_event(Event::Heartbeat {
        generation: 2,
        rank: 1,
        step: 9,
        now: ms(t + 500),
    });
    assert!(
        matches!(&out[..], [Action::Record(Record::Resumed(r))] if r.step == 9),
        "{out:?}"
    );
}

#[test]
fn growth_never_exceeds_the_configured_layout() {
    // Four nodes, a layout of two: the other two are spares in all but name.
    let mut c = Coordinator::new(cfg(4, 0, "dp=2"));
    assert_eq!(c.next_layout().unwrap(), "dp=2".parse().unwrap());
    started(&mut c, Some(2));
    // Failures are replaced while nodes remain, so nothing ever shrinks...
    let out = killed(&mut c, 0, Some(4), 1_000);
    assert_eq!(
        started_on(&out),
        Some(("dp=2".parse().unwrap(), vec![1, 2], Some(4)))
    );
    // ... and a returned node never makes the job larger than configured.
    c.on_event(Event::NodeBack {
        node: 0,
        now: ms(2_000),
    });
    assert_eq!(c.watching_commits(), None);
    assert_eq!(c.next_layout().unwrap(), "dp=2".parse().unwrap());
    // tp x pp stays; dp grows back only up to its configured 2, with room for 5.
    let mut c = Coordinator::new(Config::new(
        Topology {
            nodes: 4,
            ranks_per_node: 2,
            spares: 1,
        },
        "dp=2,tp=2".parse().unwrap(),
    ));
    c.cfg.backoff = Duration::from_millis(100);
    started(&mut c, None);
    // Only the spare left: one replica; every node back: two, not five.
    c.excluded.extend(0..4);
    assert_eq!(c.next_layout().unwrap(), "dp=1,tp=2".parse().unwrap());
    c.excluded.clear();
    assert_eq!(c.next_layout().unwrap(), "dp=2,tp=2".parse().unwrap());
}

#[test]
fn a_failure_while_waiting_to_grow_restarts_on_the_returned_node_at_once() {
    let mut c = Coordinator::new(cfg(3, 0, "dp=3"));
    started(&mut c, None);
    let out = killed(&mut c, 2, Some(4), 1_000);
    assert_eq!(
        started_on(&out),
        Some(("dp=2".parse().unwrap(), vec![0, 1], Some(4)))
    );
    c.on_event(Event::NodeBack {
        node: 2,
        now: ms(2_000),
    });
    assert_eq!(c.watching_commits(), Some(1));
    let out = killed(&mut c, 1, Some(4), 3_000);
    assert!(
        out.iter().any(|a| matches!(a,
            Action::Record(Record::Recovery(r)) if r.layout == "dp=2,tp=1,pp=1")),
        "{out:?}"
    );
    assert_eq!(
        started_on(&out),
        Some(("dp=2".parse().unwrap(), vec![0, 2], Some(4)))
    );
    assert_eq!(c.watching_commits(), None, "nothing left to grow onto");
    assert_eq!(c.restarts(), 2);
}

#[test]
fn a_node_failing_three_times_in_ten_minutes_is_kept_out_and_named() {
    let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
    started(&mut c, None);
    c.cfg.max_restarts = 10;
    // Node 1 fails at 10 s, 100 s and 300 s, and comes back after the first two.
    let mut all = Vec::new();
    for (i, at) in [10_000, 100_000].into_iter().enumerate() {
        let out = killed(&mut c, 1, Some(4), at);
        assert!(kept_out_records(&out).is_empty(), "failure {i}: {out:?}");
        all.extend(out);
        let out = back_and_grown(&mut c, 1, 8, at + 1_000);
        assert_eq!(started_on(&out).unwrap().1, vec![0, 1]);
    }
    let out = killed(&mut c, 1, Some(8), 300_000);
    assert_eq!(
        kept_out_records(&out),
        vec![&records::NodeKeptOut {
            node: 1,
            failures_ms: vec![10_000, 100_000, 300_000],
            window_s: 600.0,
            reason: "node 1 failed 3 times within 600 s (at 10000, 100000, 300000 ms): it is \
                     kept out for good, even when it comes back"
                .into(),
            at_ms: 300_000,
        }]
    );
    assert!(c.is_kept_out(1));
    // It comes back: refused, and the job does not grow onto it.
    let out = c.on_event(Event::NodeBack {
        node: 1,
        now: ms(301_000),
    });
    assert_eq!(
        out,
        vec![Action::Record(Record::NodeReturned(
            records::NodeReturned {
                node: 1,
                usable: false,
                at_ms: 301_000
            }
        ))]
    );
    assert_eq!(c.watching_commits(), None);
    assert_eq!(c.excluded(), vec![1]);
    assert_eq!(c.next_layout().unwrap(), "dp=1".parse().unwrap());
}

/// The `backoff_s` of the recovery decision in `out`.
fn backoff_of(out: &[Action]) -> f64 {
    out.iter()
        .find_map(|a| match a {
            Action::Record(Record::Recovery(r)) => Some(r.backoff_s),
            _ => None,
        })
        .expect("a recovery decision")
}

#[test]
fn the_backoff_doubles_in_a_crash_loop_and_starts_over_after_a_healthy_generation() {
    // 6 nodes, dp=1: every failure moves the job to the next node. backoff 100 ms,
    // backoff_max 30 s.
    let mut c = Coordinator::new(cfg(6, 0, "dp=1"));
    c.cfg.max_restarts = 10;
    started(&mut c, Some(4));
    // A crash loop: each generation fails a second after it starts.
    let mut at = 1_000;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let out = killed(&mut c, 0, Some(4), at);
        seen.push(backoff_of(&out));
        at += 2_000;
    }
    assert_eq!(seen, [0.1, 0.2, 0.4]);
    // The next generation runs 40 s (past backoff_max) before failing: healthy, so the
    // delay starts over ...
    at += 40_000;
    assert_eq!(backoff_of(&killed(&mut c, 0, Some(8), at)), 0.1);
    // ... and doubles again if the one after fails quickly.
    at += 1_000;
    assert_eq!(backoff_of(&killed(&mut c, 0, Some(8), at)), 0.2);
    assert_eq!(c.restarts(), 5);
}

#[test]
fn failures_spread_over_more_than_ten_minutes_do_not_keep_a_node_out() {
    let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
    c.cfg.max_restarts = 10;
    started(&mut c, None);
    // 0 s, 400 s, 700 s: never three within 600 s.
    for at in [1, 400_000, 700_000] {
        let out = killed(&mut c, 1, Some(4), at);
        assert!(kept_out_records(&out).is_empty(), "at {at}: {out:?}");
        back_and_grown(&mut c, 1, 8, at + 1_000);
    }
    assert!(!c.is_kept_out(1));
    // Two failures (flag: 2) more than ten minutes apart neither.
    let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
    c.cfg.max_node_failures = 2;
    started(&mut c, None);
    killed(&mut c, 1, Some(4), 1_000);
    back_and_grown(&mut c, 1, 8, 2_000);
    let out = killed(&mut c, 1, Some(8), 602_000);
    assert!(kept_out_records(&out).is_empty(), "{out:?}");
    back_and_grown(&mut c, 1, 12, 603_000);
    // ... but two within it do.
    let out = killed(&mut c, 1, Some(12), 700_000);
    assert_eq!(
        kept_out_records(&out)[0].failures_ms,
        vec![602_000, 700_000]
    );
}

/// Generation 0 of two ranks resuming step 10, with rank 1 reporting step 10 at 100 ms; the
/// config's heartbeat timeout is 2 s.
fn restoring(startup: Duration) -> Coordinator {
    let mut c = cfg(2, 0, "dp=2");
    c.heartbeat_timeout = Duration::from_secs(2);
    c.hang_timeout = Duration::from_secs(600);
    c.startup_timeout = startup;
    let mut c = Coordinator::new(c);
    started(&mut c, Some(10));
    assert_eq!(c.generation(), 0);
    c
}

fn alive(c: &mut Coordinator, rank: u32, t: u64) -> Vec<Action> {
    c.on_event(Event::Alive {
        generation: c.generation(),
        rank,
        now: ms(t),
    })
}

fn beat(c: &mut Coordinator, rank: u32, step: u64, t: u64) -> Vec<Action> {
    c.on_event(Event::Heartbeat {
        generation: c.generation(),
        rank,
        step,
        now: ms(t),
    })
}

fn failures(out: &[Action]) -> Vec<&records::Failure> {
    out.iter()
        .filter_map(|a| match a {
            Action::Record(Record::Failure(f)) => Some(f),
            _ => None,
        })
        .collect()
}

#[test]
fn a_rank_stopped_while_restoring_is_failed_by_its_missed_beats_not_the_startup_timeout() {
    // Start-up may take five minutes; rank 0 beats while it restores, then stops at 1 s.
    let mut c = restoring(Duration::from_secs(300));
    let mut t = 0;
    while t < 3_500 {
        t += 100;
        if t <= 1_000 {
            assert!(alive(&mut c, 0, t).is_empty());
        }
        beat(&mut c, 1, 10, t);
        let out = c.on_event(Event::Tick { now: ms(t) });
        let f = failures(&out);
        if t <= 3_000 {
            assert!(f.is_empty(), "failed at {t} ms: {out:?}");
            continue;
        }
        assert_eq!(f.len(), 1, "{out:?}");
        assert_eq!((f[0].rank, f[0].how.as_str()), (0, "heartbeat"));
        assert!(f[0].detail.contains("while starting"), "{}", f[0].detail);
        return;
    }
    panic!("the rank stopped while restoring was not failed within the heartbeat timeout");
}

#[test]
fn a_rank_that_beats_but_reports_no_step_fails_at_the_startup_timeout() {
    let mut c = restoring(Duration::from_secs(3));
    let mut t = 0;
    while t < 4_000 {
        t += 100;
        alive(&mut c, 0, t);
        beat(&mut c, 1, 10 + t / 1_000, t);
        let out = c.on_event(Event::Tick { now: ms(t) });
        let f = failures(&out);
        if t <= 3_000 {
            assert!(f.is_empty(), "failed at {t} ms: {out:?}");
            continue;
        }
        assert_eq!(f.len(), 1, "{out:?}");
        assert_eq!((f[0].rank, f[0].how.as_str()), (0, "startup"));
        assert!(f[0].detail.contains("reported no step"), "{}", f[0].detail);
        return;
    }
    panic!("beats without a step held off the startup timeout");
}

#[test]
fn a_data_failure_after_starting_beats_is_the_steps_not_the_nodes() {
    let mut c = restoring(Duration::from_secs(300));
    assert!(alive(&mut c, 0, 100).is_empty());
    let out = c.on_event(Event::Exited {
        generation: 0,
        rank: 0,
        status: ExitStatus::Code(DATA_FAILURE_EXIT),
        now: ms(200),
    });
    assert!(failures(&out).is_empty(), "a node was blamed: {out:?}");
    assert!(out.contains(&Action::Signal {
        generation: 0,
        ranks: vec![1],
        kill: false
    }));
    // Once a rank reported its step, the same exit is a failure of its own.
    let mut c = restoring(Duration::from_secs(300));
    beat(&mut c, 0, 10, 100);
    let out = c.on_event(Event::Exited {
        generation: 0,
        rank: 0,
        status: ExitStatus::Code(DATA_FAILURE_EXIT),
        now: ms(200),
    });
    assert_eq!(failures(&out).len(), 1, "{out:?}");
}

fn stopped(c: &mut Coordinator, rank: u32, is: bool, t: u64) -> Vec<Action> {
    c.on_event(Event::Stopped {
        generation: c.generation(),
        rank,
        stopped: is,
        now: ms(t),
    })
}

#[test]
fn a_rank_stopped_before_its_first_beat_is_failed_within_the_heartbeat_timeout() {
    // Start-up may take five minutes; rank 0 never beats: the driver sees its process stopped
    // at 500 ms (the soak's SIGSTOP between a rank's exec and its first beat).
    let mut c = restoring(Duration::from_secs(300));
    let mut t = 0;
    while t < 3_000 {
        t += 100;
        if t == 500 {
            assert!(stopped(&mut c, 0, true, t).is_empty());
        }
        if t > 500 {
            // Seen again at every look: the stop counts from the first.
            stopped(&mut c, 0, true, t);
        }
        beat(&mut c, 1, 10, t);
        let out = c.on_event(Event::Tick { now: ms(t) });
        let f = failures(&out);
        if t <= 2_500 {
            assert!(f.is_empty(), "failed at {t} ms: {out:?}");
            continue;
        }
        assert_eq!(f.len(), 1, "{out:?}");
        assert_eq!((f[0].rank, f[0].how.as_str()), (0, "heartbeat"));
        assert!(
            f[0].detail.contains("stopped") && f[0].detail.contains("before its first heartbeat"),
            "{}",
            f[0].detail
        );
        return;
    }
    panic!("the rank stopped before its first beat was not failed within the heartbeat timeout");
}

#[test]
fn a_rank_continued_before_the_heartbeat_timeout_is_not_failed() {
    // Stopped at 500 ms, running again at 1.5 s, then starting slowly without a beat: only the
    // start-up timeout (5 minutes) applies to it.
    let mut c = restoring(Duration::from_secs(300));
    let mut t = 0;
    while t < 10_000 {
        t += 100;
        match t {
            500 => assert!(stopped(&mut c, 0, true, t).is_empty()),
            1_500 => assert!(stopped(&mut c, 0, false, t).is_empty()),
            _ => {}
        }
        beat(&mut c, 1, 10, t);
        let out = c.on_event(Event::Tick { now: ms(t) });
        assert!(failures(&out).is_empty(), "failed at {t} ms: {out:?}");
    }
}

fn mismatch(c: &mut Coordinator, step: u64, suspects: Vec<u32>, t: u64) -> Vec<Action> {
    c.on_event(Event::ReplicaMismatch {
        generation: c.generation(),
        step,
        suspects,
        detail: "tensor \"w\" chunk 3".into(),
        now: ms(t),
    })
}

#[test]
fn a_replica_mismatch_under_rollback_keeps_the_suspect_node_out_and_restores_an_older_step() {
    let mut conf = cfg(3, 1, "dp=3");
    conf.on_replica_mismatch = MismatchPolicy::Rollback;
    let mut c = Coordinator::new(conf);
    started(&mut c, Some(10));
    assert_eq!(c.watching_replicas(), Some((0, Some(10))));
    let out = mismatch(&mut c, 20, vec![2], 1_000);
    let f = failures(&out);
    assert_eq!(f.len(), 1, "{out:?}");
    assert_eq!(
        (f[0].rank, f[0].node, f[0].how.as_str()),
        (2, 2, "replica_mismatch")
    );
    assert!(f[0].detail.contains("step 20"), "{}", f[0].detail);
    assert_eq!(kept_out_records(&out)[0].node, 2);
    assert!(out.iter().any(|a| matches!(a,
        Action::Record(Record::StepUnusable(u)) if u.step == 20)));
    assert!(out.contains(&Action::Signal {
        generation: 0,
        ranks: vec![0, 1, 2],
        kill: false
    }));
    assert_eq!(c.watching_replicas(), None, "stopping: no more watching");
    let mut out = vec![];
    for r in 0..3 {
        out = c.on_event(Event::Exited {
            generation: 0,
            rank: r,
            status: ExitStatus::Signal(15),
            now: ms(1_100),
        });
    }
    // Only steps before 20 are candidates; 20 and the later 30 come back damaged and retire.
    assert_eq!(
        out,
        vec![Action::ChooseStep {
            generation: 0,
            skip: vec![20],
            below: Some(20)
        }]
    );
    let out = c.on_event(Event::StepChosen {
        generation: 0,
        step: Some(10),
        damaged: vec![(20, "replicas".into()), (30, "after 20".into())],
        now: ms(1_200),
    });
    assert!(out.contains(&Action::RetireStep { step: 20 }));
    assert!(out.contains(&Action::RetireStep { step: 30 }));
    let mut t = 1_200;
    let started = loop {
        t += 100;
        let out = c.on_event(Event::Tick { now: ms(t) });
        if let Some(s) = started_on(&out) {
            break s;
        }
        assert!(t < 10_000);
    };
    // The spare replaces node 2, which never comes back.
    assert_eq!(started, ("dp=3".parse().unwrap(), vec![0, 1, 3], Some(10)));
    assert!(c.is_kept_out(2));
    assert!(
        c.on_event(Event::NodeBack {
            node: 2,
            now: ms(t)
        })
        .iter()
        .all(|a| matches!(a, Action::Record(Record::NodeReturned(n)) if !n.usable))
    );
}

#[test]
fn a_replica_mismatch_without_a_majority_rolls_back_keeping_every_node_and_stop_ends_the_job() {
    let mut conf = cfg(2, 0, "dp=2");
    conf.on_replica_mismatch = MismatchPolicy::Rollback;
    let mut c = Coordinator::new(conf);
    started(&mut c, Some(10));
    let out = mismatch(&mut c, 20, vec![], 1_000);
    assert!(failures(&out).is_empty(), "no suspect: no failure: {out:?}");
    assert!(kept_out_records(&out).is_empty());
    assert!(out.iter().any(|a| matches!(a,
        Action::Record(Record::StepUnusable(u)) if u.step == 20 && u.why.contains("no majority"))));
    // Warn: the coordinator does not even ask.
    let mut c = Coordinator::new(cfg(2, 0, "dp=2"));
    started(&mut c, Some(10));
    assert_eq!(c.watching_replicas(), None);
    assert!(mismatch(&mut c, 20, vec![1], 1_000).is_empty());
    // Stop: the job ends, naming the step.
    let mut conf = cfg(2, 0, "dp=2");
    conf.on_replica_mismatch = MismatchPolicy::Stop;
    let mut c = Coordinator::new(conf);
    started(&mut c, Some(10));
    let out = mismatch(&mut c, 20, vec![], 1_000);
    assert!(out.iter().any(|a| matches!(a,
        Action::Done { ok: false, reason } if reason.contains("step 20"))));
    assert!(c.is_done());
}

#[test]
fn the_resumed_record_says_when_every_rank_had_restored_and_when_the_first_step_was_done() {
    let mut c = Coordinator::new(cfg(3, 1, "dp=2"));
    started(&mut c, None);
    let out = killed(&mut c, 1, Some(4), 1_000);
    let (layout, nodes, from) = started_on(&out).expect("a new generation");
    assert_eq!((layout.world(), nodes.len(), from), (2, 2, Some(4)));
    let g = c.generation();
    let beat = |c: &mut Coordinator, rank: u32, step: u64, at: u64| {
        c.on_event(Event::Heartbeat {
            generation: g,
            rank,
            step,
            now: ms(at),
        })
    };
    // Rank 0 restored step 4 at 2 s; rank 1 at 3.5 s; the first step after it done at 5 s.
    assert!(beat(&mut c, 0, 4, 2_000).is_empty());
    assert!(beat(&mut c, 1, 4, 3_500).is_empty());
    let out = beat(&mut c, 0, 5, 5_000);
    let r = match &out[..] {
        [Action::Record(Record::Resumed(r))] => r.clone(),
        other => panic!("{other:?}"),
    };
    // The failure was seen at 1 s (the kill's exit).
    assert_eq!(r.step, 5);
    assert!((r.since_failure_s - 4.0).abs() < 1e-9, "{r:?}");
    assert_eq!(r.restored_s.map(|s| (s * 1000.0).round()), Some(2_500.0));
    // The next generation measures its own ranks: one that never reported a step leaves it
    // unknown.
    let out = killed(&mut c, 0, Some(5), 6_000);
    assert!(started_on(&out).is_some());
    let g = c.generation();
    let out = c.on_event(Event::Heartbeat {
        generation: g,
        rank: 0,
        step: 6,
        now: ms(8_000),
    });
    match &out[..] {
        [Action::Record(Record::Resumed(r))] => assert_eq!(r.restored_s, None, "{r:?}"),
        other => panic!("{other:?}"),
    }
}
