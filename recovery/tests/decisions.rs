//! Decision tables for the coordinator: each case is a schedule of events with the exact
//! actions expected after each one (`-` for none). Times are milliseconds.

use std::time::Duration;

use ckpt_recovery::coordinator::{
    Action, Config, Coordinator, Event, ExitStatus, Record, Topology,
};
use ckpt_recovery::records;

const CASES: &str = r#"
# A crash (SIGKILL) on one of 4 single-rank nodes: stop the others, restore, shrink dp.
config nodes=4 rpn=1 spares=0 layout=dp=4
0    start            => choose g0
0    chosen g0 none   => start g0 dp=4,tp=1,pp=1 nodes=0,1,2,3 from=-
100  beat g0 r0 s5    => -
100  beat g0 r1 s5    => -
150  exit g0 r2 sig=9 => failure g0 r2 node=2 how=signal; term g0 [0,1,3]
160  exit g0 r0 sig=15 => -
170  exit g0 r1 code=1 => -
180  exit g0 r3 sig=15 => choose g0
190  chosen g0 4      => decision dp=3,tp=1,pp=1 step=4 lost=1
250  tick             => -
300  tick             => start g1 dp=3,tp=1,pp=1 nodes=0,1,3 from=4
500  beat g1 r0 s4    => -
600  beat g1 r0 s5    => resumed g1 s5
700  exit g1 r0 code=0 => -
700  exit g1 r1 code=0 => -
700  exit g1 r2 code=0 => finished ok; done ok

# Spares replace a failed node: the layout stays.
config nodes=2 rpn=2 spares=1 layout=dp=2,tp=2
0    start            => choose g0
0    chosen g0 none   => start g0 dp=2,tp=2,pp=1 nodes=0,1 from=-
50   exit g0 r3 code=101 => failure g0 r3 node=1 how=exit; term g0 [0,1,2]
60   exit g0 r0 sig=15 => -
60   exit g0 r1 sig=15 => -
60   exit g0 r2 sig=15 => choose g0
70   chosen g0 none   => decision dp=2,tp=2,pp=1 step=- lost=0
300  tick             => start g1 dp=2,tp=2,pp=1 nodes=0,2 from=-

# A hang (SIGSTOP: no more heartbeats) is found within the timeout plus one tick; a rank
# that ignores SIGTERM is killed after the grace period.
config nodes=2 rpn=1 spares=0 layout=tp=2 heartbeat=1000 grace=500
0    start            => choose g0
0    chosen g0 none   => start g0 dp=1,tp=2,pp=1 nodes=0,1 from=-
100  beat g0 r0 s1    => -
100  beat g0 r1 s1    => -
900  beat g0 r0 s2    => -
1050 tick             => -
1150 tick             => failure g0 r1 node=1 how=heartbeat; term g0 [0,1]
1200 exit g0 r0 sig=15 => -
1600 tick             => -
1700 tick             => kill g0 [1]
1710 exit g0 r1 sig=9 => choose g0
1720 chosen g0 none   => finished fail; done fail

# No step progress while heartbeats keep coming is a hang too.
config nodes=2 rpn=1 spares=1 layout=dp=2 hang=2000
0    start            => choose g0
0    chosen g0 none   => start g0 dp=2,tp=1,pp=1 nodes=0,1 from=-
100  beat g0 r0 s3    => -
100  beat g0 r1 s3    => -
1500 beat g0 r0 s4    => -
1500 beat g0 r1 s3    => -
2200 beat g0 r1 s3    => -
2200 tick             => failure g0 r1 node=1 how=hang; term g0 [0,1]

# Two failures in a row, then too few survivors for tp x pp.
config nodes=3 rpn=2 spares=0 layout=dp=3,tp=2
0    start            => choose g0
0    chosen g0 none   => start g0 dp=3,tp=2,pp=1 nodes=0,1,2 from=-
10   exit g0 r5 sig=9 => failure g0 r5 node=2 how=signal; term g0 [0,1,2,3,4]
20   exit g0 r0 sig=15 => -
20   exit g0 r1 sig=15 => -
20   exit g0 r2 sig=15 => -
20   exit g0 r3 sig=15 => -
20   exit g0 r4 sig=15 => choose g0
30   chosen g0 8      => decision dp=2,tp=2,pp=1 step=8 lost=0
300  tick             => start g1 dp=2,tp=2,pp=1 nodes=0,1 from=8
310  exit g1 r0 sig=9 => failure g1 r0 node=0 how=signal; term g1 [1,2,3]
320  exit g1 r1 sig=9 => failure g1 r1 node=0 how=signal
330  exit g1 r2 sig=15 => -
330  exit g1 r3 sig=15 => choose g1
340  chosen g1 8      => decision dp=1,tp=2,pp=1 step=8 lost=0
800  tick             => start g2 dp=1,tp=2,pp=1 nodes=1 from=8
900  exit g2 r1 code=3 => failure g2 r1 node=1 how=exit; term g2 [0]
910  exit g2 r0 sig=15 => choose g2
920  chosen g2 8      => finished fail; done fail

# Restarts are bounded.
config nodes=4 rpn=1 spares=0 layout=dp=4 max_restarts=1
0    start            => choose g0
0    chosen g0 none   => start g0 dp=4,tp=1,pp=1 nodes=0,1,2,3 from=-
10   exit g0 r0 sig=9 => failure g0 r0 node=0 how=signal; term g0 [1,2,3]
20   exit g0 r1 sig=15 => -
20   exit g0 r2 sig=15 => -
20   exit g0 r3 sig=15 => choose g0
30   chosen g0 2      => decision dp=3,tp=1,pp=1 step=2 lost=0
300  tick             => start g1 dp=3,tp=1,pp=1 nodes=1,2,3 from=2
310  exit g1 r0 sig=9 => failure g1 r0 node=1 how=signal; term g1 [1,2]
320  exit g1 r1 sig=15 => -
320  exit g1 r2 sig=15 => choose g1
330  chosen g1 2      => finished fail; done fail

# Events of an older generation are ignored.
config nodes=2 rpn=1 spares=0 layout=dp=2
0    start            => choose g0
0    chosen g0 none   => start g0 dp=2,tp=1,pp=1 nodes=0,1 from=-
10   exit g0 r1 sig=9 => failure g0 r1 node=1 how=signal; term g0 [0]
20   exit g0 r0 sig=15 => choose g0
30   chosen g0 none   => decision dp=1,tp=1,pp=1 step=- lost=0
300  tick             => start g1 dp=1,tp=1,pp=1 nodes=0 from=-
310  exit g0 r0 sig=9 => -
320  beat g0 r0 s99   => -
330  exit g1 r0 code=0 => finished ok; done ok

# A rank cannot restore the chosen step because of its data (exit 65 before its first beat):
# no node is excluded; the step is verified, marked unusable, and the next older one chosen;
# the unusable steps after it are retired. Such restarts do not count against max_restarts.
config nodes=2 rpn=1 spares=1 layout=dp=2 max_restarts=0
0    start            => choose g0
0    chosen g0 12     => start g0 dp=2,tp=1,pp=1 nodes=0,1 from=12
100  exit g0 r1 code=65 => term g0 [0]
110  exit g0 r0 code=65 => check g0 s12
120  checked g0 s12 damaged => unusable g0 s12 by=r1; choose g0 skip=12
130  chosen g0 8      => retire s12; decision dp=2,tp=1,pp=1 step=8 lost=0
300  tick             => start g1 dp=2,tp=1,pp=1 nodes=0,1 from=8
400  exit g1 r0 code=65 => term g1 [1]
410  exit g1 r1 sig=15 => check g1 s8
420  checked g1 s8 damaged => unusable g1 s8 by=r0; choose g1 skip=8,12
430  chosen g1 4      => retire s8; decision dp=2,tp=1,pp=1 step=4 lost=0
700  tick             => start g2 dp=2,tp=1,pp=1 nodes=0,1 from=4
800  beat g2 r0 s5    => resumed g2 s5
900  exit g2 r0 code=0 => -
900  exit g2 r1 code=0 => finished ok; done ok

# Choosing finds the newest step's objects missing: it is marked unusable and retired, and the
# first generation restores the older step.
config nodes=1 rpn=1 spares=0 layout=dp=1
0    start            => choose g0
0    chosen g0 4 damaged=8 => unusable g0 s8 by=-; retire s8; start g0 dp=1,tp=1,pp=1 nodes=0 from=4

# The rank reports damaged data but the store's copy verifies clean: what it read was damaged
# on its node, which is failed and replaced by the spare; the same step is chosen again.
config nodes=2 rpn=1 spares=1 layout=dp=2
0    start            => choose g0
0    chosen g0 8      => start g0 dp=2,tp=1,pp=1 nodes=0,1 from=8
100  exit g0 r0 code=65 => term g0 [1]
110  exit g0 r1 sig=15 => check g0 s8
120  checked g0 s8 clean => failure g0 r0 node=0 how=restore; choose g0
130  chosen g0 8      => decision dp=2,tp=1,pp=1 step=8 lost=0
300  tick             => start g1 dp=2,tp=1,pp=1 nodes=1,2 from=8

# Exit 65 after the rank's first heartbeat (it had restored) or without a chosen step is an
# ordinary failure.
config nodes=3 rpn=1 spares=0 layout=dp=2
0    start            => choose g0
0    chosen g0 8      => start g0 dp=2,tp=1,pp=1 nodes=0,1 from=8
100  beat g0 r0 s8    => -
200  exit g0 r0 code=65 => failure g0 r0 node=0 how=exit; term g0 [1]
210  exit g0 r1 sig=15 => choose g0
220  chosen g0 none   => decision dp=2,tp=1,pp=1 step=- lost=8
500  tick             => start g1 dp=2,tp=1,pp=1 nodes=1,2 from=-
510  exit g1 r0 code=65 => failure g1 r0 node=1 how=exit; term g1 [1]

# Every committed step is damaged: the job stops and says so (nothing is retired).
config nodes=1 rpn=1 spares=0 layout=dp=1
0    start            => choose g0
0    chosen g0 4      => start g0 dp=1,tp=1,pp=1 nodes=0 from=4
100  exit g0 r0 code=65 => check g0 s4
110  checked g0 s4 damaged => unusable g0 s4 by=r0; choose g0 skip=4
120  chosen g0 none   => finished fail; done fail

# A layout bigger than the nodes is refused at the start.
config nodes=1 rpn=2 spares=0 layout=dp=4
0    start            => finished fail; done fail
"#;

fn parse_config(line: &str) -> Config {
    let mut t = Topology {
        nodes: 1,
        ranks_per_node: 1,
        spares: 0,
    };
    let mut layout = "dp=1".to_string();
    let mut kv = Vec::new();
    for part in line.split_whitespace().skip(1) {
        let (k, v) = part.split_once('=').unwrap();
        match k {
            "nodes" => t.nodes = v.parse().unwrap(),
            "rpn" => t.ranks_per_node = v.parse().unwrap(),
            "spares" => t.spares = v.parse().unwrap(),
            "layout" => layout = part["layout=".len()..].to_string(),
            _ => kv.push((k.to_string(), v.to_string())),
        }
    }
    let mut c = Config::new(t, layout.parse().unwrap());
    c.backoff = Duration::from_millis(100);
    for (k, v) in kv {
        let ms = || Duration::from_millis(v.parse().unwrap());
        match k.as_str() {
            "heartbeat" => c.heartbeat_timeout = ms(),
            "hang" => c.hang_timeout = ms(),
            "grace" => c.stop_grace = ms(),
            "max_restarts" => c.max_restarts = v.parse().unwrap(),
            other => panic!("unknown config key {other}"),
        }
    }
    c
}

fn num(s: &str, prefix: char) -> u64 {
    s.trim_start_matches(prefix).parse().unwrap()
}

fn parse_event(now: Duration, words: &[&str]) -> Event {
    match words[0] {
        "start" => Event::Start { now },
        "tick" => Event::Tick { now },
        "beat" => Event::Heartbeat {
            generation: num(words[1], 'g'),
            rank: num(words[2], 'r') as u32,
            step: num(words[3], 's'),
            now,
        },
        "exit" => {
            let (k, v) = words[3].split_once('=').unwrap();
            let status = match k {
                "code" => ExitStatus::Code(v.parse().unwrap()),
                _ => ExitStatus::Signal(v.parse().unwrap()),
            };
            Event::Exited {
                generation: num(words[1], 'g'),
                rank: num(words[2], 'r') as u32,
                status,
                now,
            }
        }
        // chosen gG STEP|none [damaged=S,S..]
        "chosen" => Event::StepChosen {
            generation: num(words[1], 'g'),
            step: (words[2] != "none").then(|| words[2].parse().unwrap()),
            damaged: words
                .get(3)
                .and_then(|w| w.strip_prefix("damaged="))
                .map(|l| {
                    l.split(',')
                        .map(|s| (s.parse().unwrap(), format!("step {s} is damaged")))
                        .collect()
                })
                .unwrap_or_default(),
            now,
        },
        // checked gG sS damaged|clean
        "checked" => Event::StepChecked {
            generation: num(words[1], 'g'),
            step: num(words[2], 's'),
            damage: (words[3] == "damaged").then(|| "an object is damaged".to_string()),
            now,
        },
        other => panic!("unknown event {other}"),
    }
}

fn show(a: &Action) -> Option<String> {
    Some(match a {
        Action::Start {
            generation,
            layout,
            assignments,
            resume_from,
        } => {
            let mut nodes: Vec<u32> = assignments.iter().map(|x| x.node).collect();
            nodes.dedup();
            let nodes: Vec<String> = nodes.iter().map(u32::to_string).collect();
            format!(
                "start g{generation} {layout_s} nodes={} from={}",
                nodes.join(","),
                resume_from.map_or("-".into(), |s| s.to_string()),
                layout_s = full(layout)
            )
        }
        Action::Signal {
            generation,
            ranks,
            kill,
        } => {
            let r: Vec<String> = ranks.iter().map(u32::to_string).collect();
            format!(
                "{} g{generation} [{}]",
                if *kill { "kill" } else { "term" },
                r.join(",")
            )
        }
        Action::ChooseStep {
            generation,
            skip,
            below,
        } => {
            let mut out = format!("choose g{generation}");
            if !skip.is_empty() {
                let s: Vec<String> = skip.iter().map(u64::to_string).collect();
                out += &format!(" skip={}", s.join(","));
            }
            if let Some(b) = below {
                out += &format!(" below={b}");
            }
            out
        }
        Action::CheckStep { generation, step } => format!("check g{generation} s{step}"),
        Action::RetireStep { step } => format!("retire s{step}"),
        Action::Record(Record::StepUnusable(records::StepUnusable {
            generation,
            step,
            rank,
            ..
        })) => format!(
            "unusable g{generation} s{step} by={}",
            rank.map_or("-".into(), |r| format!("r{r}"))
        ),
        Action::Record(Record::Failure(records::Failure {
            generation,
            rank,
            node,
            how,
            ..
        })) => format!("failure g{generation} r{rank} node={node} how={how}"),
        Action::Record(Record::Recovery(records::Recovery {
            layout,
            step,
            steps_lost,
            ..
        })) => {
            format!(
                "decision {} step={} lost={steps_lost}",
                full(&layout.parse().unwrap()),
                step.map_or("-".into(), |s| s.to_string())
            )
        }
        Action::Record(Record::Resumed(records::Resumed {
            generation, step, ..
        })) => format!("resumed g{generation} s{step}"),
        Action::Record(Record::Finished(records::Finished { ok, .. })) => {
            format!("finished {}", if *ok { "ok" } else { "fail" })
        }
        Action::Record(_) => return None,
        Action::Done { ok, .. } => format!("done {}", if *ok { "ok" } else { "fail" }),
    })
}

fn full(l: &ckpt_store::Layout) -> String {
    format!("dp={},tp={},pp={}", l.dp, l.tp, l.pp)
}

#[test]
fn decision_tables() {
    let mut coord: Option<Coordinator> = None;
    let mut case = String::new();
    for (n, raw) in CASES.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(c) = line.strip_prefix('#') {
            case = c.trim().to_string();
            continue;
        }
        if line.starts_with("config") {
            coord = Some(Coordinator::new(parse_config(line)));
            continue;
        }
        let (ev, want) = line.split_once("=>").unwrap();
        let words: Vec<&str> = ev.split_whitespace().collect();
        let now = Duration::from_millis(words[0].parse().unwrap());
        let c = coord.as_mut().unwrap();
        let got: Vec<String> = c
            .on_event(parse_event(now, &words[1..]))
            .iter()
            .filter_map(show)
            .collect();
        let got = if got.is_empty() {
            "-".to_string()
        } else {
            got.join("; ")
        };
        assert_eq!(got, want.trim(), "case {case:?}, line {}: {line}", n + 1);
    }
}

#[test]
fn too_few_survivors_say_what_would_work() {
    let mut c = Coordinator::new(Config::new(
        Topology {
            nodes: 2,
            ranks_per_node: 2,
            spares: 0,
        },
        "dp=1,tp=4".parse().unwrap(),
    ));
    c.on_event(Event::Start {
        now: Duration::ZERO,
    });
    c.on_event(Event::StepChosen {
        generation: 0,
        step: None,
        damaged: vec![],
        now: Duration::ZERO,
    });
    let mut acts = c.on_event(Event::Exited {
        generation: 0,
        rank: 3,
        status: ExitStatus::Signal(9),
        now: Duration::from_millis(1),
    });
    for r in 0..3 {
        acts = c.on_event(Event::Exited {
            generation: 0,
            rank: r,
            status: ExitStatus::Signal(15),
            now: Duration::from_millis(2),
        });
    }
    assert!(matches!(acts.last(), Some(Action::ChooseStep { .. })));
    let acts = c.on_event(Event::StepChosen {
        generation: 0,
        step: Some(4),
        damaged: vec![],
        now: Duration::from_millis(3),
    });
    let reason = acts
        .iter()
        .find_map(|a| match a {
            Action::Done { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .unwrap();
    assert!(
        reason.contains("hold 2 ranks")
            && reason.contains("tp x pp = 4 x 1 = 4")
            && reason.contains("add nodes"),
        "{reason}"
    );
}
