//! Naming the field a TOML parse error is about.

/// The dotted name of the field a TOML error points at: the key on the error's line,
/// under the nearest `[table]` header above it.
pub(super) fn field_at(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return "<document>".into();
    };
    let before = &text[..span.start.min(text.len())];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    let line = text[line_start..line_end].trim();
    let is_header = line.starts_with('[') && line.ends_with(']');
    let header = |l: &str| l.trim_matches(|c| c == '[' || c == ']').trim().to_string();
    let table = if is_header {
        Some(header(line))
    } else {
        before[..line_start]
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| l.starts_with('[') && l.ends_with(']'))
            .map(header)
    };
    // serde names an unknown key itself; otherwise the key is the one on the error's line.
    let named = e
        .message()
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split('`').next());
    let key = match named {
        Some(k) => k,
        None if is_header => "",
        None => line.split('=').next().unwrap_or("").trim(),
    };
    match (table, key.is_empty()) {
        (Some(t), false) => format!("{t}.{key}"),
        (Some(t), true) => t,
        (None, false) => key.to_string(),
        (None, true) => "<document>".into(),
    }
}
