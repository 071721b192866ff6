//! The argument parsers.

use super::*;

#[test]
fn batch_ranges_parse_and_skip() {
    assert_eq!(parse_batch_range("11-15"), Ok((11, 15)));
    assert_eq!(parse_batch_range(" 7 "), Ok((7, 7)));
    for bad in ["0-3", "5-4", "a-b", "3-", ""] {
        assert!(parse_batch_range(bad).is_err(), "{bad:?}");
    }
    let skips = [(3, 4), (5, 6), (10, 10)];
    let cases = [(1, 1), (3, 7), (4, 7), (7, 7), (10, 11), (12, 12)];
    for (pos, want) in cases {
        assert_eq!(next_batch(&skips, pos), want, "from {pos}");
    }
    assert_eq!(next_batch(&[], 9), 9);
}

#[test]
fn persist_budget_is_a_fraction_a_percentage_or_off() {
    assert_eq!(parse_budget("0.1"), Ok(Budget::Fraction(0.1)));
    assert_eq!(parse_budget("25%"), Ok(Budget::Fraction(0.25)));
    assert_eq!(parse_budget(" off "), Ok(Budget::Off));
    for bad in ["0", "-0.1", "nan", "ten", "%"] {
        assert!(parse_budget(bad).is_err(), "{bad}");
    }
}

#[test]
fn ckpt_every_is_steps_or_auto() {
    assert_eq!(parse_ckpt_every("25"), Ok(CkptEvery::Steps(25)));
    assert_eq!(parse_ckpt_every("auto"), Ok(CkptEvery::Auto));
    for bad in ["0", "-3", "often", ""] {
        let e = parse_ckpt_every(bad).unwrap_err();
        assert!(e.contains("auto"), "{bad:?}: {e}");
    }
}

#[test]
fn injection_scales_targets() {
    let a = TrainArgs::parse_from([
        "ckpt-train",
        "--store",
        "/tmp/x",
        "--run",
        "r",
        "--steps",
        "9",
        "--inject-spike-at",
        "3,5",
        "--inject-nan-at",
        "4",
        "--skip-batches",
        "6-7,9",
    ]);
    assert_eq!(a.target_scale(3), SPIKE_SCALE);
    assert_eq!(a.target_scale(5), SPIKE_SCALE);
    assert!(a.target_scale(4).is_nan());
    assert_eq!(a.target_scale(2), 1.0);
    assert_eq!(a.skip_batches, vec![(6, 7), (9, 9)]);
    assert_eq!(a.on_spike, SpikeAction::Alert);
    assert_eq!(a.monitor_config().window, DEFAULT_WINDOW);
}
