//! The README's lists of operators with and without a gradient rule are the rule table's
//! (`graph::autodiff::ruled_ops`) against ONNX's own operator schemas (the `onnx`
//! package of the venv): every default-domain operator up to opset 21 whose schema marks
//! an input and an output differentiable, and which has no rule, is in the list of those
//! without one; nothing else is. The lists cannot drift from the code.

use std::collections::BTreeSet;

use crate::common;

/// Default-domain operators (opset <= 21, not deprecated) with a differentiable input and
/// a differentiable output, by ONNX's schemas.
fn differentiable_ops() -> BTreeSet<String> {
    let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let script = r#"
import onnx.defs as D
latest = {}
for s in D.get_all_schemas_with_history():
    if s.domain == "" and s.since_version <= 21:
        if s.name not in latest or s.since_version > latest[s.name].since_version:
            latest[s.name] = s
diff = D.OpSchema.DifferentiationCategory.Differentiable
for name, s in sorted(latest.items()):
    if not s.deprecated and any(i.differentiation_category == diff for i in s.inputs) \
            and any(o.differentiation_category == diff for o in s.outputs):
        print(name)
"#;
    let out = std::process::Command::new(&python)
        .args(["-c", script])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (run `bash scripts/setup.sh`)", python.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The README's text between `<!-- NAME -->` and `<!-- /NAME -->`.
fn readme_block(name: &str) -> String {
    let text = std::fs::read_to_string(common::peers_dir().join("../README.md")).unwrap();
    let (start, end) = (format!("<!-- {name} -->"), format!("<!-- /{name} -->"));
    let from = text
        .find(&start)
        .unwrap_or_else(|| panic!("README: no {start}"))
        + start.len();
    let to = text[from..]
        .find(&end)
        .unwrap_or_else(|| panic!("README: no {end}"))
        + from;
    text[from..to].trim().to_string()
}

fn listed(ops: &BTreeSet<String>) -> String {
    ops.iter()
        .map(|o| format!("`{o}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
fn the_readme_lists_every_operator_with_and_without_a_gradient_rule() {
    let ruled: BTreeSet<String> = pipetrain::graph::autodiff::ruled_ops()
        .map(str::to_string)
        .collect();
    let missing: BTreeSet<String> = differentiable_ops().difference(&ruled).cloned().collect();
    assert!(!missing.contains("Add") && !ruled.is_empty());
    for (block, want) in [
        ("ops-without-rule", listed(&missing)),
        ("ops-with-rule", listed(&ruled)),
    ] {
        let have = readme_block(block);
        let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            squash(&have),
            squash(&want),
            "README's {block} list is not the rule table's; it should read:\n{want}"
        );
    }
}
