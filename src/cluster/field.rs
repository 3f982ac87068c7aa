//! Naming the field a TOML parse error is about, with array-of-tables indices.
//!
//! The same approach as the training config's (`config/field.rs`: the key on the error's
//! line under the nearest table header above it), extended for `[[nodes]]`: a manifest
//! lists its nodes as an array of tables, and "field `nodes.port`" would not say which
//! node, so the header's occurrence count gives `nodes[2].port`.

/// The dotted name of the field a TOML error points at, such as `nodes[1].address`.
pub(super) fn field_at(text: &str, e: &toml::de::Error) -> String {
    // serde names an unknown or missing key itself.
    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|p| e.message().strip_prefix(p))
        .and_then(|rest| rest.split('`').next());
    let Some(span) = e.span() else {
        return named.unwrap_or("<document>").to_string();
    };
    let start = span.start.min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    let line = strip_comment(&text[line_start..line_end]);
    // The nearest header at or above the error's line, and where it starts.
    let mut header = None;
    let mut offset = 0;
    for l in text[..line_end].split_inclusive('\n') {
        if let Some(h) = parse_header(strip_comment(l)) {
            header = Some((h, offset));
        }
        offset += l.len();
    }
    let table = header.map(|((name, is_array), at)| {
        if !is_array {
            return name;
        }
        let index = text[..at]
            .lines()
            .filter(|l| parse_header(strip_comment(l)) == Some((name.clone(), true)))
            .count();
        format!("{name}[{index}]")
    });
    let on_header = parse_header(line);
    let key = match named {
        // An unknown table is named on its own header: the table is the field.
        Some(k)
            if on_header
                .as_ref()
                .is_some_and(|(h, _)| h.rsplit('.').next() == Some(k)) =>
        {
            ""
        }
        Some(k) => k,
        None if on_header.is_some() => "",
        None => line
            .split('=')
            .next()
            .unwrap_or("")
            .trim()
            .trim_matches('"'),
    };
    match (table, key.is_empty()) {
        (Some(t), false) => format!("{t}.{key}"),
        (Some(t), true) => t,
        (None, false) => key.to_string(),
        (None, true) => "<document>".into(),
    }
}

/// `[name]` -> (name, false); `[[name]]` -> (name, true).
fn parse_header(line: &str) -> Option<(String, bool)> {
    let line = line.trim();
    if let Some(inner) = line.strip_prefix("[[").and_then(|l| l.strip_suffix("]]")) {
        return Some((inner.trim().to_string(), true));
    }
    let inner = line.strip_prefix('[')?.strip_suffix(']')?;
    Some((inner.trim().to_string(), false))
}

/// The line without a trailing `# comment` (a `#` inside a quoted string is kept).
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            (None, '#') => return line[..i].trim(),
            _ => {}
        }
    }
    line.trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Doc {
        job: Job,
        #[serde(default)]
        nodes: Vec<Node>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Job {
        name: String,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Node {
        name: String,
        port: u16,
    }

    fn field(text: &str) -> String {
        let e = toml::from_str::<Doc>(text).unwrap_err();
        field_at(text, &e)
    }

    #[test]
    fn array_tables_are_named_with_their_index() {
        let node = |i: usize, port: &str| format!("[[nodes]]\nname = \"n{i}\"\nport = {port}\n");
        let ok = node(0, "1") + &node(1, "2");
        assert_eq!(
            field(&format!("[job]\nname = \"j\"\n{ok}{}", node(2, "\"x\""))),
            "nodes[2].port"
        );
        assert_eq!(
            field(&format!("[job]\nname = \"j\"\n{}{ok}", node(0, "-1"))),
            "nodes[0].port"
        );
        // The unknown key is named by serde, on whichever line the span falls.
        let extra = format!("[job]\nname = \"j\"\n{ok}[[nodes]]\nname = \"n2\"\nprt = 3\n");
        assert_eq!(field(&extra), "nodes[2].prt");
        let missing = format!("[job]\nname = \"j\"\n{ok}[[nodes]]\nname = \"n2\"\n");
        assert_eq!(field(&missing), "nodes[2].port");
    }

    #[test]
    fn comments_and_quoted_hashes_do_not_confuse_the_names() {
        let text = "[job]   # the job\nname = \"j#1\"\n[[nodes]] # first\nname = \"a # b\" # c\nport = 99999 # too big\n";
        assert_eq!(field(text), "nodes[0].port");
        assert_eq!(field("[job] # x\nnam = \"j\"\n"), "job.nam");
        assert_eq!(field("[job]\nname = 1\n"), "job.name");
        assert_eq!(field("x = 1\n[job]\nname = \"j\"\n"), "x");
        assert_eq!(field("[jobs]\nname = \"j\"\n"), "jobs");
        assert_eq!(field(""), "job");
        assert_eq!(strip_comment("a = \"#\" # c"), "a = \"#\"");
        assert_eq!(strip_comment("a = '#' # c"), "a = '#'");
        assert_eq!(parse_header(" [[ nodes ]] "), Some(("nodes".into(), true)));
        assert_eq!(parse_header("[job]"), Some(("job".into(), false)));
        assert_eq!(parse_header("a = [1]"), None);
    }
}
