//! Built without the `etcd` feature, the recovery tests across machines (tests/etcd.rs) are
//! not compiled: this says so (and fails where nothing may be skipped, as in CI).
#![cfg(not(feature = "etcd"))]

#[test]
fn recovery_across_machines_through_etcd() {
    ckpt_store::testing::skip(
        "recovery_across_machines_through_etcd",
        "built without the etcd feature: run with `--features ckpt-tests/etcd` \
         (the etcd client's build needs protoc: apt-get install protobuf-compiler)",
    );
}
