//! Replica agents trust no stranger: a real `ckpt replica-agent` process on loopback, clients
//! that do not know the job's secret (raw frames of the protocol, and the library's own client
//! with a wrong secret), and what they can no longer do: evict, redirect a copy, park data,
//! read chunks. A restore after their attempts still reads its bytes from the agent, and an
//! agent refuses memory beyond its limit.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ckpt_recovery::peer::{
    Holdings, Membership, PeerLink, PeerSecret, PeerSource, PeerUpload, SECRET_ENV, begin_frame,
    chunk_head, end_frame, holdings,
};
use ckpt_store::testing::{det_bytes, memory_store, tiny_config};
use ckpt_store::writer::{RankWrite, ShardDesc, ShardIn};
use ckpt_store::{ChunkId, DType, DedupIndex, Layout, NdBox, StepReader, Store};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A `ckpt replica-agent` process; its log goes to a file read by [`Agent::log`].
struct Agent {
    child: Child,
    addr: String,
    node: u32,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    fn start(node: u32, secret: &PeerSecret, extra: &[&str]) -> Agent {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("agent.err");
        let mut child = Command::new(ckpt_tests::bin("ckpt", "ckpt"))
            .args(["replica-agent", "--listen", "127.0.0.1:0", "--watch-stdin"])
            .args(["--node", &node.to_string()])
            .args(extra)
            .env(SECRET_ENV, secret.to_hex())
            .env("RUST_LOG", "info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("agent printed {line:?}"))
            .to_string();
        Agent {
            child,
            addr,
            node,
            log,
            _dir: dir,
        }
    }

    /// Tell the agent the job's generation and live agents, as a supervisor does, and wait
    /// until its log shows it took them.
    fn members(&mut self, generation: u64, agents: &[(u32, String)]) {
        let line = Membership::line(generation, agents);
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.flush().unwrap();
        wait_for(
            || self.log().contains("replica agent membership"),
            "membership",
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn holdings(&self, secret: &PeerSecret) -> Holdings {
        rt().block_on(holdings(&self.addr, secret)).unwrap()
    }

    fn link(&self, secret: &PeerSecret) -> PeerLink {
        PeerLink {
            node: self.node,
            agent: self.addr.clone(),
            peers: vec![self.addr.clone()],
            timeout: Duration::from_secs(5),
            secret: secret.clone(),
        }
    }

    /// The agent's log never shows the secret.
    fn check_log_keeps(&self, secret: &PeerSecret) {
        let log = self.log();
        assert!(
            !log.contains(&secret.to_hex()),
            "the secret is in the log:\n{log}"
        );
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for(mut ok: impl FnMut() -> bool, what: &str) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(10), "no {what} in time");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn secret() -> PeerSecret {
    PeerSecret::generate().unwrap()
}

/// Hand a snapshot of these chunks to `link`'s agent; the bytes it took.
fn upload(
    link: &PeerLink,
    generation: u64,
    step: u64,
    chunks: &[Bytes],
) -> ckpt_store::Result<u64> {
    rt().block_on(async {
        let up = PeerUpload::start(link, generation, 0, step, 4);
        for c in chunks {
            up.chunk(c.clone()).await;
        }
        up.finish(chunks.iter().map(|c| ChunkId::of(c)).collect(), vec![])
            .await
            .map(|h| h.bytes)
    })
}

/// A stranger: connects, sends `bytes` without knowing the secret, and reads whatever the agent
/// sends back until it closes the connection (the challenge, at most).
fn stranger(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stranger_on(s, bytes)
}

/// The same on the agent's local (abstract Unix) socket, which every process of the machine
/// can find in `/proc/net/unix`.
fn local_stranger(a: &Agent, bytes: &[u8]) -> Vec<u8> {
    use std::os::linux::net::SocketAddrExt;
    let prefix = format!("@ckpt-replica-agent-{}-", a.child.id());
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    let name = table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .find(|n| n.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no local socket {prefix}* in /proc/net/unix"));
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(&name.as_bytes()[1..]).unwrap();
    let mut s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Sent whole and closed, so the agent does not wait out its handshake timeout.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    stranger_on(s, &[])
}

fn stranger_on(mut s: impl Read + Write, bytes: &[u8]) -> Vec<u8> {
    // Written in pieces: the agent may close before it took everything.
    for piece in bytes.chunks(64 << 10) {
        if s.write_all(piece).is_err() {
            break;
        }
    }
    let mut got = Vec::new();
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the agent kept a stranger's connection open: {e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10), "still open");
    }
    assert!(
        got.len() <= 34 && got.first().is_none_or(|b| *b == b'H'),
        "a stranger got more than the challenge: {:?}",
        &got[..got.len().min(64)]
    );
    got
}

/// Frames of a whole snapshot of `chunks`, as a client without the secret would send them;
/// `buddy`: the address field the protocol used to carry in its `B` frame.
fn snapshot_frames(node: u32, generation: u64, chunks: &[Bytes], buddy: Option<&str>) -> Vec<u8> {
    let mut f = begin_frame(node, 0, generation, u64::MAX);
    if let Some(b) = buddy {
        f.extend_from_slice(&(b.len() as u16).to_le_bytes());
        f.extend_from_slice(b.as_bytes());
    }
    for (i, c) in chunks.iter().enumerate() {
        f.extend_from_slice(&chunk_head(i as u32, c.len()));
        f.extend_from_slice(c);
    }
    f.extend_from_slice(&end_frame(
        &chunks.iter().map(|c| ChunkId::of(c)).collect::<Vec<_>>(),
    ));
    f
}

fn data(seed: u64, n: usize, len: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| Bytes::from(det_bytes(seed + i as u64, len)))
        .collect()
}

/// A one-rank step `w` (f32, 64 KiB in 16 chunks) in a memory store, and its chunks' bytes.
fn saved_step() -> (Store, Vec<u8>, Vec<Bytes>) {
    rt().block_on(async {
        let store = memory_store(tiny_config());
        let whole = det_bytes(11, 64 << 10);
        let w = RankWrite {
            generation: 1,
            ..RankWrite::new("p", 1, 0, Layout::new(1, 1, 1, 0).unwrap())
        };
        let shard = ShardIn {
            shard: ShardDesc::boxed(
                "w",
                DType::F32,
                vec![128, 128],
                NdBox::new(vec![0, 0], vec![128, 128]).unwrap(),
            ),
            data: Some(Bytes::from(whole.clone())),
        };
        store
            .write_rank(&w, vec![shard], vec![], &DedupIndex::new())
            .await
            .unwrap();
        store.log().commit_step("p", 1).await.unwrap();
        let reader = StepReader::open(&store, "p", 1).await.unwrap();
        let m = reader.manifest(0).await.unwrap();
        let mut chunks = Vec::new();
        for c in &m.tensors[0].chunks {
            chunks.push(store.chunks().get_chunk(c).await.unwrap());
        }
        assert!(chunks.len() > 4, "{} chunks", chunks.len());
        (store, whole, chunks)
    })
}

/// Restore `w` with the agents at `addrs` as the source: (bytes, raw bytes the agents served).
fn restore(store: &Store, addrs: &[String], secret: &PeerSecret) -> (Vec<u8>, u64) {
    rt().block_on(async {
        let src = PeerSource::new(addrs, secret);
        let reader = StepReader::open(store, "p", 1)
            .await
            .unwrap()
            .with_source(src.clone());
        let mut out = vec![0u8; 64 << 10];
        let bbox = NdBox::new(vec![0, 0], vec![128, 128]).unwrap();
        let stats = reader.read_into("w", &bbox, &mut out).await.unwrap();
        assert_eq!(stats.source_bytes, src.served_bytes());
        (out, stats.source_bytes)
    })
}

#[test]
fn a_stranger_cannot_evict_and_a_restore_still_reads_from_the_agent() {
    let s = secret();
    let (store, whole, chunks) = saved_step();
    let mut a = Agent::start(0, &s, &[]);
    a.members(1, &[(0, a.addr.clone())]);
    let sent = upload(&a.link(&s), 1, 1, &chunks).unwrap();
    assert_eq!(sent, whole.len() as u64);
    let before = a.holdings(&s);
    assert_eq!(before.snapshots, 1);

    // A newer generation's snapshot used to drop every older one, and a newer step of the
    // job's own generation replaces the rank's. Without the secret: raw frames, frames after a
    // made-up answer, and the real client with another job's secret.
    let junk = data(99, 1, 100);
    let other = secret();
    for generation in [1, u64::MAX] {
        stranger(&a.addr, &snapshot_frames(0, generation, &junk, None));
        let mut answered = vec![b'R'];
        answered.extend_from_slice(&[0u8; 64]);
        answered.extend_from_slice(&snapshot_frames(0, generation, &junk, None));
        stranger(&a.addr, &answered);
        assert!(upload(&a.link(&other), generation, u64::MAX, &junk).is_err());
    }
    // Even a client with the secret cannot run ahead of the job's generation (1).
    let e = upload(&a.link(&s), u64::MAX, u64::MAX, &junk).unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(
        a.log()
            .contains("generation 18446744073709551615 is refused"),
        "{}",
        a.log()
    );

    assert_eq!(a.holdings(&s), before, "nothing evicted, nothing added");
    // The restore reads every byte from the agent.
    let (got, from_agent) = restore(&store, &[a.addr.clone()], &s);
    assert!(got == whole, "restored bytes differ");
    assert_eq!(from_agent, whole.len() as u64, "bytes from the agent");
    assert!(a.log().contains("connection refused"), "{}", a.log());
    a.check_log_keeps(&s);
}

#[test]
fn a_stranger_cannot_redirect_a_copy() {
    let s = secret();
    // Where a stranger would like the copy to go.
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_addr = trap.local_addr().unwrap().to_string();
    let mut a = Agent::start(0, &s, &[]);
    let mut b = Agent::start(1, &s, &[]);
    let members = [(0, a.addr.clone()), (1, b.addr.clone())];
    a.members(1, &members);
    b.members(1, &members);
    let chunks = data(5, 3, 5000);
    // The old protocol's `B` frame named the buddy; without the secret it is not read at all.
    stranger(
        &a.addr,
        &snapshot_frames(0, 1, &chunks, Some(trap_addr.as_str())),
    );
    // With the secret, there is no field to name one: the copy goes to the membership's buddy.
    upload(&a.link(&s), 1, 1, &chunks).unwrap();
    wait_for(|| b.holdings(&s).snapshots == 1, "the buddy's copy");
    std::thread::sleep(Duration::from_millis(300));
    match trap.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("the agent connected to the stranger's address: {other:?}"),
    }
    // The buddy takes copies from its ward's agent only: a rank of node 0 cannot park a
    // snapshot of node 0 at node 1's agent.
    assert!(upload(&b.link(&s).clone_for_node(0), 1, 2, &chunks).is_err());
    assert_eq!(b.holdings(&s).snapshots, 1);
    a.check_log_keeps(&s);
    b.check_log_keeps(&s);
}

/// A link of another node to the same agent.
trait ForNode {
    fn clone_for_node(&self, node: u32) -> PeerLink;
}

impl ForNode for PeerLink {
    fn clone_for_node(&self, node: u32) -> PeerLink {
        PeerLink {
            node,
            ..self.clone()
        }
    }
}

#[test]
fn a_stranger_cannot_park_data() {
    let s = secret();
    let mut a = Agent::start(0, &s, &[]);
    a.members(1, &[(0, a.addr.clone())]);
    // 8 MiB in 1 MiB chunks: raw, and through the client with another job's secret.
    let big = data(7, 8, 1 << 20);
    let t = Instant::now();
    stranger(&a.addr, &snapshot_frames(0, 1, &big, None));
    assert!(upload(&a.link(&secret()), 1, 1, &big).is_err());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(a.holdings(&s), Holdings::default(), "nothing parked");
    assert!(
        a.log().matches("connection refused").count() >= 2,
        "{}",
        a.log()
    );
    a.check_log_keeps(&s);
}

#[test]
fn a_stranger_cannot_read_chunks() {
    let s = secret();
    let mut a = Agent::start(0, &s, &[]);
    a.members(1, &[(0, a.addr.clone())]);
    let chunks = data(3, 4, 3000);
    upload(&a.link(&s), 1, 1, &chunks).unwrap();
    let mut get = vec![b'G'];
    get.extend_from_slice(&ChunkId::of(&chunks[0]).0.0);
    // Raw `G`, then `G` after a made-up answer to the challenge: the challenge and nothing else.
    stranger(&a.addr, &get);
    let mut answered = vec![b'R'];
    answered.extend_from_slice(&[0u8; 64]);
    answered.extend_from_slice(&get);
    stranger(&a.addr, &answered);
    // Nor does the local socket that maps the agent's memory give its segments away.
    local_stranger(&a, b"X");
    let mut answered = vec![b'R'];
    answered.extend_from_slice(&[0u8; 64]);
    answered.push(b'X');
    local_stranger(&a, &answered);
    // The real client with another job's secret gets nothing either.
    let ask = |secret: &PeerSecret| {
        rt().block_on(async {
            let src = PeerSource::new(&[a.addr.clone()], secret);
            let r = ckpt_store::ChunkRef {
                id: ChunkId::of(&chunks[1]),
                len: chunks[1].len() as u32,
                stored: chunks[1].len() as u32,
                codec: ckpt_store::codec::Codec::Raw,
                pack: None,
                offset: 0,
                bases: Vec::new(),
                base_step: None,
            };
            use ckpt_store::ChunkSource;
            (src.fetch(&r).await, src.served_bytes())
        })
    };
    assert_eq!(ask(&secret()), (None, 0));
    assert_eq!(ask(&s), (Some(chunks[1].clone()), chunks[1].len() as u64));
    a.check_log_keeps(&s);
}

#[test]
fn memory_beyond_the_limit_is_refused() {
    let s = secret();
    let mut a = Agent::start(0, &s, &["--memory-limit", "1MiB"]);
    a.members(1, &[(0, a.addr.clone())]);
    let e = upload(&a.link(&s), 1, 1, &data(1, 4, 512 << 10)).unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(a.holdings(&s), Holdings::default());
    wait_for(
        || a.log().contains("memory limit"),
        "the memory limit's log line",
    );
    // Nothing of the refused snapshot stays reserved: one within the limit is kept.
    let ok = data(2, 3, 256 << 10);
    assert_eq!(upload(&a.link(&s), 1, 2, &ok).unwrap(), 3 * (256 << 10));
    assert_eq!(a.holdings(&s).bytes, 3 * (256 << 10));
    // A snapshot that would not fit next to it is refused; the one held stays.
    assert!(upload(&a.link(&s), 1, 3, &data(3, 2, 512 << 10)).is_err());
    assert_eq!(a.holdings(&s).bytes, 3 * (256 << 10));
    a.check_log_keeps(&s);
}

#[test]
fn an_agent_without_the_secret_does_not_start() {
    let out = Command::new(ckpt_tests::bin("ckpt", "ckpt"))
        .args(["replica-agent", "--listen", "127.0.0.1:0"])
        .env_remove(SECRET_ENV)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(SECRET_ENV), "{err}");
}
