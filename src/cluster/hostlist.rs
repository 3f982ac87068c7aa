//! Expanding Slurm host lists (`node[01-04,07],gpu-a1`) into host names.
//!
//! Slurm writes an allocation's nodes compressed (`SLURM_JOB_NODELIST`); `scontrol show
//! hostnames` expands them, but a launcher should not need Slurm's binaries. The one Rust
//! crate for this (`hostlist`) pulls in `nom` 6 and `clap` 2 and has not changed in years,
//! so this is a small expander of its own. It gives what python-hostlist 2.3 gives on
//! every case of the tests (checked one by one):
//! - hosts are separated by commas outside brackets;
//! - `[a-b,c]` inside a host expands to each number; several bracket groups in one host
//!   multiply, the leftmost varying slowest (`r[1-2]n[1-2]` is `r1n1, r1n2, r2n1, r2n2`);
//! - numbers are zero-padded to the width of the range's low bound as written (`[08-10]`
//!   is `08, 09, 10`; `[8-10]` is `8, 9, 10`);
//! - order is kept, nothing is sorted.
//!
//! It differs where python-hostlist forgives: an empty entry (`a,,b`) is an error rather
//! than skipped, as Slurm never writes one; and duplicates are kept rather than dropped,
//! so a manifest built from them fails on its duplicate node names instead of silently
//! running fewer nodes.

/// The most hosts one list may expand to (64 Ki), so a mistyped range such as
/// `n[1-999999999]` is refused rather than filling memory.
pub const MAX_HOSTS: usize = 64 * 1024;

/// The host names of a Slurm host list, in order.
///
/// # Errors
/// Why the list is malformed (empty entries, unbalanced or nested brackets, a bound that
/// is not a number, a descending range, more than [`MAX_HOSTS`] hosts), naming where.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("the host list is empty".into());
    }
    let mut hosts = Vec::new();
    for item in split_top(list)? {
        if item.is_empty() {
            return Err(format!(
                "`{list}` has an empty entry (two commas, or one at an end)"
            ));
        }
        expand_item(item, &mut hosts)?;
    }
    Ok(hosts)
}

/// Splits at commas outside brackets, checking that brackets pair up and do not nest.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("`{list}`: nested `[` at byte {i}")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("`{list}`: `]` without `[` at byte {i}")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            c if c.is_whitespace() || c.is_control() => {
                return Err(format!(
                    "`{list}`: whitespace or a control character at byte {i}"
                ))
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(format!("`{list}`: `[` is never closed"));
    }
    items.push(&list[start..]);
    Ok(items)
}

/// Appends the hosts of one entry such as `rack[1-2]-n[01-03]`.
fn expand_item(item: &str, hosts: &mut Vec<String>) -> Result<(), String> {
    let mut names = vec![String::new()];
    let mut rest = item;
    while !rest.is_empty() {
        let Some(open) = rest.find('[') else {
            names.iter_mut().for_each(|n| n.push_str(rest));
            break;
        };
        let close = open + rest[open..].find(']').unwrap_or(rest.len() - open);
        let prefix = &rest[..open];
        let numbers = expand_ranges(item, &rest[open + 1..close])?;
        let count = names.len().saturating_mul(numbers.len());
        if hosts.len().saturating_add(count) > MAX_HOSTS {
            return Err(format!("`{item}` expands to more than {MAX_HOSTS} hosts"));
        }
        names = names
            .iter()
            .flat_map(|n| numbers.iter().map(move |x| format!("{n}{prefix}{x}")))
            .collect();
        rest = &rest[close + 1..];
    }
    hosts.extend(names);
    Ok(())
}

/// `01-03,7` -> `01, 02, 03, 7`.
fn expand_ranges(item: &str, ranges: &str) -> Result<Vec<String>, String> {
    if ranges.is_empty() {
        return Err(format!("`{item}`: empty brackets"));
    }
    let mut out = Vec::new();
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let number = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "`{item}`: `{range}` is not a number or a range a-b of numbers"
                ));
            }
            s.parse::<u64>()
                .map_err(|_| format!("`{item}`: `{s}` is too large"))
        };
        let (a, b) = (number(lo)?, number(hi)?);
        if a > b {
            return Err(format!("`{item}`: the range `{range}` goes down"));
        }
        if b - a >= MAX_HOSTS as u64 || out.len() + (b - a) as usize >= MAX_HOSTS {
            return Err(format!("`{item}` expands to more than {MAX_HOSTS} hosts"));
        }
        out.extend((a..=b).map(|x| format!("{x:0width$}", width = lo.len())));
    }
    Ok(out)
}
