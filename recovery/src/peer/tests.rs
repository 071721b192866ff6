//! The agent, the upload and the source together over loopback.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ckpt_store::{ChunkId, ChunkRef, ChunkSource};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::auth::{Role, connect};
use super::*;

fn secret() -> PeerSecret {
    PeerSecret::from_bytes([7; 32])
}

async fn agent_of(node: u32) -> (String, Arc<AgentState>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let st = AgentState::new(node, Some(secret()), u64::MAX);
    tokio::spawn(serve(l, st.clone()));
    (addr, st)
}

async fn agent() -> (String, Arc<AgentState>) {
    agent_of(0).await
}

fn chunk(data: &[u8]) -> ChunkRef {
    ChunkRef {
        id: ChunkId::of(data),
        len: data.len() as u32,
        stored: data.len() as u32,
        codec: ckpt_store::codec::Codec::Raw,
        pack: None,
        offset: 0,
        bases: Vec::new(),
        base_step: None,
    }
}

/// The agents of nodes 0 and 1, each the other's buddy (generation 1), and node 0's ranks'
/// link to them.
async fn buddies() -> (String, Arc<AgentState>, String, Arc<AgentState>, PeerLink) {
    let (a, sa) = agent_of(0).await;
    let (b, sb) = agent_of(1).await;
    let agents = [(0, a.clone()), (1, b.clone())];
    sa.set_membership(Membership::of(0, 1, &agents));
    sb.set_membership(Membership::of(1, 1, &agents));
    let link = PeerLink {
        node: 0,
        agent: a.clone(),
        peers: vec![a.clone(), b.clone()],
        timeout: IO_TIMEOUT,
        secret: secret(),
    };
    (a, sa, b, sb, link)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_reaches_the_agent_and_its_buddy_and_is_served_by_id() {
    let (_, sa, b, sb, link) = buddies().await;
    let data: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 1000 + i as usize]).collect();
    let ids: Vec<ChunkId> = data.iter().map(|d| ChunkId::of(d)).collect();
    let up = PeerUpload::start(&link, 1, 3, 7, 2);
    for d in &data {
        up.chunk(Bytes::from(d.clone())).await;
    }
    let sent = up.finish(ids, vec![]).await.unwrap().bytes;
    assert_eq!(sent, data.iter().map(|d| d.len() as u64).sum::<u64>());
    // The buddy's copy arrives asynchronously.
    for _ in 0..200 {
        if sb.holdings().chunks == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sa.holdings().chunks, 5);
    assert_eq!(sb.holdings(), sa.holdings());
    assert_eq!(holdings(&b, &secret()).await.unwrap(), sb.holdings());

    // Served by id from the buddy alone (the node's agent is gone), nothing for others.
    let src = PeerSource::new(&["127.0.0.1:1".to_string(), b.clone()], &secret());
    for d in &data {
        assert_eq!(src.fetch(&chunk(d)).await.unwrap(), Bytes::from(d.clone()));
    }
    assert!(src.fetch(&chunk(b"not there")).await.is_none());
    assert_eq!(src.served_bytes(), sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_snapshot_is_not_kept_and_newer_generations_replace_older() {
    let (a, sa) = agent_of(1).await;
    let link = PeerLink {
        node: 1,
        agent: a.clone(),
        peers: vec![a.clone()],
        timeout: IO_TIMEOUT,
        secret: secret(),
    };
    let up = PeerUpload::start(&link, 1, 0, 1, 4);
    up.chunk(Bytes::from_static(b"half")).await;
    drop(up);
    let up = PeerUpload::start(&link, 1, 0, 2, 4);
    up.chunk(Bytes::from_static(b"old generation")).await;
    up.finish(vec![ChunkId::of(b"old generation")], vec![])
        .await
        .unwrap();
    let up = PeerUpload::start(&link, 2, 5, 3, 4);
    up.chunk(Bytes::from_static(b"new generation")).await;
    up.finish(vec![ChunkId::of(b"new generation")], vec![])
        .await
        .unwrap();
    // A wrong count is refused and nothing of it is kept.
    let up = PeerUpload::start(&link, 2, 5, 4, 4);
    up.chunk(Bytes::from_static(b"x")).await;
    assert!(up.finish(vec![], vec![]).await.is_err());
    drop(up);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(sa.get(&ChunkId::of(b"half")).is_none());
    assert!(sa.get(&ChunkId::of(b"old generation")).is_none());
    assert!(sa.get(&ChunkId::of(b"new generation")).is_some());
    assert_eq!(sa.holdings().snapshots, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_agent_holds_up_neither_a_persist_nor_a_restore() {
    // Accepts connections, never reads or answers (a SIGSTOPped agent looks like this).
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let held = Arc::new(Mutex::new(Vec::new()));
    let h2 = held.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            h2.lock().push(s);
        }
    });
    let t = Duration::from_millis(300);
    let link = PeerLink {
        node: 0,
        agent: addr.clone(),
        peers: vec![addr.clone()],
        timeout: t,
        secret: secret(),
    };
    let t0 = std::time::Instant::now();
    let up = PeerUpload::start(&link, 0, 0, 1, 2);
    let big = Bytes::from(vec![7u8; 4 << 20]);
    for _ in 0..16 {
        up.chunk(big.clone()).await; // 64 MiB: far past the socket buffers
    }
    assert!(
        up.finish(vec![ChunkId::of(&big); 16], vec![])
            .await
            .is_err()
    );
    let src = PeerSource::with_timeout(&[addr], &secret(), t);
    assert!(src.fetch(&chunk(&big)).await.is_none());
    assert!(
        src.fetch(&chunk(&big)).await.is_none(),
        "given up, not asked again"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// An authenticated connection, as a rank.
async fn authed(addr: &str) -> TcpStream {
    connect(addr, &secret(), Role::Rank).await.unwrap()
}

#[tokio::test]
async fn hostile_frames_end_the_connection_without_allocating() {
    let (a, sa) = agent().await;
    let mut s = authed(&a).await;
    s.write_all(&chunk_head(0, 0)).await.unwrap(); // a chunk outside a snapshot
    let mut s2 = authed(&a).await;
    let mut f = begin_frame(0, 0, 0, 0);
    f.extend_from_slice(&chunk_head(0, 0)[..5]);
    f.extend_from_slice(&u64::MAX.to_le_bytes());
    s2.write_all(&f).await.unwrap();
    let mut one = [0u8; 1];
    assert_eq!(s.read(&mut one).await.unwrap(), 0, "closed");
    assert_eq!(s2.read(&mut one).await.unwrap(), 0, "closed");
    assert_eq!(sa.holdings(), Holdings::default());
}

#[tokio::test]
async fn the_memory_limit_and_the_membership_bound_what_an_agent_takes() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap().to_string();
    let st = AgentState::new(2, Some(secret()), 10_000);
    tokio::spawn(serve(l, st.clone()));
    st.set_membership(Membership::parse_line(2, "members 5 1=x:1,2=y:2,3=z:3").unwrap());
    assert_eq!(st.membership().buddy.as_deref(), Some("z:3"));
    assert_eq!(st.membership().wards, Some(vec![1]));
    let link = PeerLink {
        node: 2,
        agent: a.clone(),
        peers: vec![a.clone()],
        timeout: IO_TIMEOUT,
        secret: secret(),
    };
    let send = |generation, step, data: Vec<u8>| {
        let link = link.clone();
        async move {
            let up = PeerUpload::start(&link, generation, 0, step, 4);
            let id = ChunkId::of(&data);
            up.chunk(Bytes::from(data)).await;
            up.finish(vec![id], vec![]).await
        }
    };
    // Beyond the limit: refused, nothing kept, nothing left reserved.
    assert!(send(5, 1, vec![1; 20_000]).await.is_err());
    assert_eq!(st.holdings(), Holdings::default());
    // A generation later than the job's: refused (it would evict everything).
    assert!(send(6, 1, vec![2; 100]).await.is_err());
    send(5, 2, vec![3; 6_000]).await.unwrap();
    assert_eq!(st.holdings().bytes, 6_000);
    // The next snapshot of the same rank needs room next to the newest one: that one is
    // what the job resumes from if the next never commits.
    assert!(send(5, 3, vec![4; 6_000]).await.is_err());
    assert_eq!(st.steps_of(2, 0), vec![2]);
    send(5, 3, vec![4; 3_000]).await.unwrap();
    // Room for both: the one before stays (its chunks still served).
    assert_eq!(st.holdings().bytes, 9_000);
    assert_eq!(st.holdings().snapshots, 2);
    assert_eq!(st.steps_of(2, 0), vec![3, 2]);
    assert!(st.get(&ChunkId::of(&[3; 6_000])).is_some());
    // The next one needs room the older of the two gives up, the newest stays.
    send(5, 4, vec![5; 3_000]).await.unwrap();
    assert_eq!(st.steps_of(2, 0), vec![4, 3]);
    assert_eq!(st.holdings().bytes, 6_000);
    assert!(st.get(&ChunkId::of(&[3; 6_000])).is_none());
    assert!(st.get(&ChunkId::of(&[4; 3_000])).is_some());
    // A step arriving late (older than the newest) changes nothing.
    send(5, 1, vec![6; 100]).await.unwrap();
    assert_eq!(st.steps_of(2, 0), vec![4, 3]);
    assert!(st.get(&ChunkId::of(&[6; 100])).is_none());
    // A rank of another node cannot park its snapshot here.
    let mut other = link.clone();
    other.node = 7;
    let up = PeerUpload::start(&other, 5, 0, 9, 4);
    up.chunk(Bytes::from_static(b"x")).await;
    assert!(up.finish(vec![ChunkId::of(b"x")], vec![]).await.is_err());
    assert_eq!(st.holdings().snapshots, 2);
    assert!(Membership::parse_line(0, "members x").is_err());
    assert!(Membership::parse_line(0, "hello 1 0=a").is_err());
}

#[tokio::test]
async fn a_client_without_the_secret_is_refused_and_an_impostor_agent_is_noticed() {
    let (a, _) = agent().await;
    let wrong = PeerSecret::from_bytes([8; 32]);
    let e = connect(&a, &wrong, Role::Rank).await.unwrap_err();
    assert!(e.to_string().contains("CKPT_PEER_SECRET"), "{e}");
    assert!(holdings(&a, &wrong).await.is_err());
    // A client knowing the secret notices an agent that does not.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let b = l.local_addr().unwrap().to_string();
    let st = AgentState::new(0, Some(wrong), u64::MAX);
    tokio::spawn(serve(l, st));
    assert!(connect(&b, &secret(), Role::Rank).await.is_err());
    // Secrets: hex round trip, no text in errors or Debug.
    let s = PeerSecret::generate().unwrap();
    assert_eq!(PeerSecret::from_hex(&s.to_hex()).unwrap(), s);
    assert!(!format!("{s:?}").contains(&s.to_hex()[..8]));
    let bad = "zz".repeat(32);
    let e = PeerSecret::from_hex(&bad).unwrap_err();
    assert!(!e.to_string().contains("zz"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_on_the_agents_machine_maps_its_memory_and_a_stranger_maps_nothing() {
    let (a, sa) = agent().await;
    let link = PeerLink {
        node: 0,
        agent: a.clone(),
        peers: vec![a.clone()],
        timeout: IO_TIMEOUT,
        secret: secret(),
    };
    // Chunks of several sizes, one larger than a segment's remainder would hold after the rest.
    let data: Vec<Vec<u8>> = (0..6u8)
        .map(|i| {
            (0..(1000 + i as usize * 70_001))
                .map(|j| (j as u8) ^ i)
                .collect()
        })
        .collect();
    let ids: Vec<ChunkId> = data.iter().map(|d| ChunkId::of(d)).collect();
    let up = PeerUpload::start(&link, 0, 2, 9, 2);
    for d in &data {
        up.chunk(Bytes::from(d.clone())).await;
    }
    let sent = up.finish(ids.clone(), vec![]).await.unwrap().bytes;

    // Mapped: every byte, none through the socket.
    let src = PeerSource::new(std::slice::from_ref(&a), &secret());
    for d in &data {
        assert_eq!(src.fetch(&chunk(d)).await.unwrap(), Bytes::from(d.clone()));
    }
    assert!(src.fetch(&chunk(b"not there")).await.is_none());
    assert_eq!((src.served_bytes(), src.mapped_bytes()), (sent, sent));
    // A copy the reader refuses (its hash failed) is taken back from both counts.
    src.refused(&chunk(&data[2]));
    let back = data[2].len() as u64;
    assert_eq!(
        (src.served_bytes(), src.mapped_bytes()),
        (sent - back, sent - back)
    );

    // A newer snapshot replaces the old one at the agent; what a client mapped stays readable
    // and unchanged (the agent never writes a listed chunk again).
    let mut kept = Vec::new();
    for d in &data {
        kept.push(src.fetch(&chunk(d)).await.unwrap());
    }
    let up = PeerUpload::start(&link, 1, 2, 10, 2);
    up.chunk(Bytes::from_static(b"newer")).await;
    up.finish(vec![ChunkId::of(b"newer")], vec![])
        .await
        .unwrap();
    assert!(sa.get(&ids[0]).is_none());
    for (k, d) in kept.iter().zip(&data) {
        assert_eq!(k, &Bytes::from(d.clone()));
    }

    // With mapping off, the same through the socket.
    let src = PeerSource::new(std::slice::from_ref(&a), &secret());
    src.map_same_machine(false);
    assert_eq!(
        src.fetch(&chunk(b"newer")).await.unwrap(),
        Bytes::from_static(b"newer")
    );
    assert_eq!((src.served_bytes(), src.mapped_bytes()), (5, 0));

    // A client without the secret is refused before anything is sent.
    let name = sa.local_socket().expect("a local socket");
    let wrong = PeerSecret::from_bytes([8; 32]);
    let got = tokio::task::spawn_blocking(move || super::shm::import(&name, &wrong, IO_TIMEOUT))
        .await
        .unwrap();
    let err = got.err().expect("refused").to_string();
    assert!(err.contains("CKPT_PEER_SECRET is not the job's"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unchanged_chunks_are_named_not_sent_and_the_buddy_gets_them_all_the_same() {
    let (_, sa, b, sb, link) = buddies().await;
    let frozen: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i; 2000]).collect();
    let frozen_ids: Vec<ChunkId> = frozen.iter().map(|d| ChunkId::of(d)).collect();
    let wait_for = |s: Arc<AgentState>, step: u64| async move {
        for _ in 0..300 {
            if s.steps_of(0, 2).first() == Some(&step) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "step {step} never reached the agent: {:?}",
            s.steps_of(0, 2)
        );
    };
    // Step 1 sends everything.
    let up = PeerUpload::start(&link, 1, 2, 1, 4);
    for d in &frozen {
        up.chunk(Bytes::from(d.clone())).await;
    }
    up.chunk(Bytes::from_static(b"adapter at step 1")).await;
    let mut ids = frozen_ids.clone();
    ids.push(ChunkId::of(b"adapter at step 1"));
    let h1 = up.finish(ids, vec![]).await.unwrap();
    assert_eq!((h1.bytes, h1.missing), (8000 + 17, 0));
    wait_for(sb.clone(), 1).await;
    // Steps 2 and 3 send the changed chunk only and name the others.
    for step in [2u64, 3] {
        let adapter = format!("adapter at step {step}").into_bytes();
        let up = PeerUpload::start(&link, 1, 2, step, 4);
        up.chunk(Bytes::from(adapter.clone())).await;
        let h = up
            .finish(vec![ChunkId::of(&adapter)], frozen_ids.clone())
            .await
            .unwrap();
        assert_eq!(
            (h.bytes, h.missing),
            (adapter.len() as u64, 0),
            "step {step}"
        );
        wait_for(sb.clone(), step).await;
    }
    // Both agents hold step 3 whole (and step 2 before it), each step's chunks served.
    for s in [&sa, &sb] {
        assert_eq!(s.steps_of(0, 2), vec![3, 2]);
        for id in frozen_ids
            .iter()
            .chain([&ChunkId::of(b"adapter at step 3")])
        {
            assert!(s.get(id).is_some(), "{id:?}");
        }
        // Step 1 (and its adapter) is gone; its frozen chunks live on in the newer steps.
        assert!(s.get(&ChunkId::of(b"adapter at step 1")).is_none());
        assert_eq!(s.holdings().snapshots, 2);
        assert_eq!(s.holdings().chunks, 2 * 5);
    }
    let src = PeerSource::new(std::slice::from_ref(&b), &secret());
    for d in &frozen {
        assert_eq!(src.fetch(&chunk(d)).await.unwrap(), Bytes::from(d.clone()));
    }

    // An agent that lacks named chunks (restarted: it holds nothing) keeps what came and says
    // how many it lacks; the buddy, which lacks them too, gets the copy in full.
    let (c, sc, _, sd, link) = buddies().await;
    let up = PeerUpload::start(&link, 1, 2, 4, 4);
    up.chunk(Bytes::from_static(b"adapter at step 4")).await;
    let h = up
        .finish(vec![ChunkId::of(b"adapter at step 4")], frozen_ids.clone())
        .await
        .unwrap();
    assert_eq!(h.missing, 4);
    assert_eq!(sc.steps_of(0, 2), vec![4]);
    assert_eq!(sc.holdings().chunks, 1);
    // Node 0's agent named to its buddy only what it held: the buddy keeps the same.
    wait_for(sd.clone(), 4).await;
    assert_eq!(sd.holdings().chunks, 1);
    // Once node 0's agent holds them (the rank's next save sends everything), a buddy that
    // lacks what it is named is sent the copy in full.
    let up = PeerUpload::start(&link, 1, 2, 5, 4);
    for d in &frozen[..2] {
        up.chunk(Bytes::from(d.clone())).await;
    }
    let h = up.finish(frozen_ids[..2].to_vec(), vec![]).await.unwrap();
    assert_eq!(h.missing, 0);
    wait_for(sd.clone(), 5).await;
    let (e, se) = agent_of(1).await;
    sc.set_membership(Membership::of(0, 1, &[(0, c.clone()), (1, e.clone())]));
    se.set_membership(Membership::of(1, 1, &[(0, c.clone()), (1, e.clone())]));
    let up = PeerUpload::start(&link, 1, 2, 6, 4);
    up.chunk(Bytes::from_static(b"adapter at step 6")).await;
    let h = up
        .finish(
            vec![ChunkId::of(b"adapter at step 6")],
            frozen_ids[..2].to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(h.missing, 0);
    wait_for(se.clone(), 6).await;
    // The buddy holds step 6 first without the named chunks (the copy that names them), then
    // whole once the copy in full arrives after it answered that it lacks them.
    for _ in 0..300 {
        if se.holdings().chunks == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        se.holdings().chunks,
        3,
        "the new buddy lacks the named chunks"
    );
    for id in &frozen_ids[..2] {
        assert!(se.get(id).is_some());
    }
}
