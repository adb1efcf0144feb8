//! Slurm host lists: `node[01-04],gpu7` is node01, node02, node03, node04, gpu7.
//!
//! The grammar is Slurm's: a comma-separated list (commas inside brackets belong to the
//! bracket) of names, each with any number of bracketed parts; a bracket holds a
//! comma-separated list of numbers and ranges `a-b` (`a <= b`); a number written with leading
//! zeros keeps its width (`[08-10]` is 08, 09, 10). Several brackets in one name give every
//! combination, leftmost outermost (`r[1-2]n[1-2]`: r1n1, r1n2, r2n1, r2n2). Order is kept and
//! nothing is sorted or deduplicated (the caller refuses duplicates).

/// Most names one list may expand to.
pub const MAX_HOSTS: usize = 65_536;

/// Expands a Slurm host list; errors name the offending part.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in split_top(list)? {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!("empty name in host list {list:?}"));
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    check_plain(rest, item)?;
                    names.iter_mut().for_each(|n| n.push_str(rest));
                    rest = "";
                }
                Some(open) => {
                    let close = rest[open..]
                        .find(']')
                        .map(|c| open + c)
                        .ok_or_else(|| format!("unclosed '[' in {item:?}"))?;
                    let plain = &rest[..open];
                    check_plain(plain, item)?;
                    let parts = numbers(&rest[open + 1..close], item)?;
                    if names.len().saturating_mul(parts.len()) + out.len() > MAX_HOSTS {
                        return Err(format!(
                            "host list {list:?} names more than {MAX_HOSTS} hosts"
                        ));
                    }
                    names = names
                        .iter()
                        .flat_map(|n| parts.iter().map(move |p| format!("{n}{plain}{p}")))
                        .collect();
                    rest = &rest[close + 1..];
                }
            }
        }
        out.extend(names);
    }
    if out.is_empty() {
        return Err("empty host list".into());
    }
    Ok(out)
}

/// Splits at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut parts) = (0u32, 0usize, Vec::new());
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("nested '[' in host list {list:?}")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("']' without '[' in host list {list:?}")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(format!("unclosed '[' in host list {list:?}"));
    }
    parts.push(&list[start..]);
    Ok(parts)
}

fn check_plain(s: &str, item: &str) -> Result<(), String> {
    match s
        .chars()
        .find(|c| c.is_whitespace() || matches!(c, ']' | ',' | '[' | '/'))
    {
        Some(c) => Err(format!("unexpected {c:?} in host name {item:?}")),
        None => Ok(()),
    }
}

/// The numbers of one bracket, formatted with their widths.
fn numbers(inside: &str, item: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in inside.split(',') {
        let part = part.trim();
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 18 && s.bytes().all(|c| c.is_ascii_digit());
        if !digits(a) || !digits(b) {
            return Err(format!(
                "bad range {part:?} in {item:?} (expected N or N-M)"
            ));
        }
        let (x, y): (u64, u64) = (a.parse().unwrap_or(0), b.parse().unwrap_or(0));
        if y < x {
            return Err(format!("descending range {part:?} in {item:?}"));
        }
        if y - x >= MAX_HOSTS as u64 || out.len() + (y - x) as usize >= MAX_HOSTS {
            return Err(format!(
                "range {part:?} in {item:?} names more than {MAX_HOSTS} hosts"
            ));
        }
        // Zero padding: the width of the first number when it has leading zeros.
        let width = if a.len() > 1 && a.starts_with('0') {
            a.len()
        } else {
            0
        };
        out.extend((x..=y).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::expand;

    fn ok(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn plain_names_and_lists() {
        assert_eq!(ok("gpu7"), ["gpu7"]);
        assert_eq!(ok("a,b, c"), ["a", "b", "c"]);
        assert_eq!(ok("node01.cluster.org"), ["node01.cluster.org"]);
    }

    #[test]
    fn ranges_with_and_without_zero_padding() {
        assert_eq!(
            ok("node[01-04],gpu7"),
            ["node01", "node02", "node03", "node04", "gpu7"]
        );
        assert_eq!(ok("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(ok("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(ok("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(ok("n[0-1]"), ["n0", "n1"]);
        assert_eq!(ok("n[007]"), ["n007"]);
    }

    #[test]
    fn lists_inside_brackets_and_suffixes() {
        assert_eq!(ok("n[1,3,5-6]-ib"), ["n1-ib", "n3-ib", "n5-ib", "n6-ib"]);
        assert_eq!(ok("[1-2]x"), ["1x", "2x"]);
    }

    #[test]
    fn multiple_brackets_give_every_combination() {
        assert_eq!(ok("r[1-2]n[01-02]"), ["r1n01", "r1n02", "r2n01", "r2n02"]);
        assert_eq!(
            ok("r[1-2]n[1,3],login"),
            ["r1n1", "r1n3", "r2n1", "r2n3", "login"]
        );
    }

    #[test]
    fn bad_lists_are_refused_with_the_reason() {
        for (list, says) in [
            ("", "empty"),
            ("a,,b", "empty name"),
            ("n[1-", "unclosed"),
            ("n1-2]", "without '['"),
            ("n[[1]]", "nested"),
            ("n[4-2]", "descending"),
            ("n[a-b]", "bad range"),
            ("n[]", "bad range"),
            ("n[1-2", "unclosed"),
            ("n[0-99999999]", "more than"),
            ("bad name", "unexpected"),
        ] {
            let e = expand(list).unwrap_err();
            assert!(e.contains(says), "{list:?}: {e}");
        }
    }
}
