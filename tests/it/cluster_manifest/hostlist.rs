//! Slurm host lists. Every expected value below is what python-hostlist 2.3's
//! `expand_hostlist` gives for the same input, except where a comment says otherwise.

use pipetrain::cluster::{expand_hostlist, MAX_HOSTS};

fn hosts(list: &str) -> Vec<String> {
    expand_hostlist(list).unwrap_or_else(|e| panic!("{list}: {e}"))
}

#[test]
fn host_lists_expand_ranges_lists_groups_and_zero_padding() {
    let cases: &[(&str, &[&str])] = &[
        ("gpu-a1", &["gpu-a1"]),
        ("a,b,c", &["a", "b", "c"]),
        (
            "node[01-04,07],gpu-a1",
            &["node01", "node02", "node03", "node04", "node07", "gpu-a1"],
        ),
        // Width of the low bound as written.
        ("n[8-10]", &["n8", "n9", "n10"]),
        ("n[08-10]", &["n08", "n09", "n10"]),
        ("n[008-10]", &["n008", "n009", "n010"]),
        (
            "n[1-010]",
            &["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"],
        ),
        ("x[0]", &["x0"]),
        ("x[00]", &["x00"]),
        ("n[9-9]", &["n9"]),
        // Order as written, not sorted.
        ("n[3,1-2]", &["n3", "n1", "n2"]),
        ("b,a", &["b", "a"]),
        // A suffix after the brackets, and several groups (the leftmost slowest).
        ("a[1-3]-ib", &["a1-ib", "a2-ib", "a3-ib"]),
        ("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]),
        (
            "pre[1-2]mid[01-02]post",
            &[
                "pre1mid01post",
                "pre1mid02post",
                "pre2mid01post",
                "pre2mid02post",
            ],
        ),
        // Several entries with brackets; surrounding whitespace trimmed.
        (" c[1-2],d[09-10]\n", &["c1", "c2", "d09", "d10"]),
        // Duplicates kept (python-hostlist drops them by default).
        ("a,a", &["a", "a"]),
    ];
    for (list, expect) in cases {
        assert_eq!(hosts(list), *expect, "{list}");
    }
    assert_eq!(hosts("n[1-1000]").len(), 1000);
    assert_eq!(hosts("n[1-1000]")[999], "n1000");
}

#[test]
fn malformed_host_lists_are_refused_saying_why() {
    let cases = [
        ("", "empty"),
        ("   ", "empty"),
        ("a[", "never closed"),
        ("a]", "`]` without `[`"),
        ("a[[1]]", "nested"),
        ("a[]", "empty brackets"),
        ("a[1-]", "not a number"),
        ("a[-1]", "not a number"),
        ("a[1-2-3]", "not a number"),
        ("a[x]", "not a number"),
        ("a[1,]", "not a number"),
        ("a[3-1]", "goes down"),
        // python-hostlist skips empty entries; Slurm never writes them.
        ("a,,b", "empty entry"),
        (",a", "empty entry"),
        ("a,", "empty entry"),
        ("a b", "whitespace"),
        ("n[1-99999999999999999999999]", "too large"),
        ("n[1-100000]", "more than 65536 hosts"),
        ("n[1-300]m[1-300]", "more than 65536 hosts"),
    ];
    for (list, why) in cases {
        match expand_hostlist(list) {
            Err(e) => assert!(e.contains(why), "{list:?}: `{e}` lacks `{why}`"),
            Ok(h) => panic!("{list:?} expanded to {} hosts", h.len()),
        }
    }
    assert_eq!(MAX_HOSTS, 65536);
    assert_eq!(hosts("n[1-65536]").len(), MAX_HOSTS);
}
