//! zram-generator's size expressions (`zram-size`, `zram-resident-limit`): arithmetic over
//! `ram`, the host's MemTotal in MiB, with a result in MiB. They are evaluated with
//! `fasteval`, the evaluator zram-generator itself uses (with the same features), so an
//! expression means here what it means there: `+ - * / % ^`, `min`, `max`, `floor`, `ceil`,
//! `round`, `int`, `abs`, `log`, trigonometry, `e`, `pi`, and SI suffixes (`k` = 10^3,
//! `M` = 10^6, `G` = 10^9, ...) on numbers.

use fasteval::Evaler;

/// Why an expression was refused; every variant names the config key.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum ExprError {
    /// The text is not an expression.
    #[error("{key} = {expr:?} is not a valid expression: {reason} (zram-generator syntax, e.g. \"min(ram / 2, 4096)\")")]
    Parse {
        /// The config key.
        key: &'static str,
        /// The text.
        expr: String,
        /// The parser's message.
        reason: String,
    },
    /// The expression names something other than `ram` or a function it does not know.
    #[error("{key} = {expr:?} cannot be evaluated: {reason} (the only variable is ram, MemTotal in MiB)")]
    Eval {
        /// The config key.
        key: &'static str,
        /// The text.
        expr: String,
        /// The evaluator's message.
        reason: String,
    },
    /// The result is negative or not a number.
    #[error(
        "{key} = {expr:?} evaluates to {value} MiB with ram = {ram_mib}: it must be 0 or more"
    )]
    Negative {
        /// The config key.
        key: &'static str,
        /// The text.
        expr: String,
        /// The result.
        value: f64,
        /// `ram` it was evaluated with.
        ram_mib: u64,
    },
}

/// Evaluates `expr` (config key `key`) with `ram` = `ram_mib`; the result is in MiB.
pub fn eval_mib(key: &'static str, expr: &str, ram_mib: u64) -> Result<f64, ExprError> {
    let mut slab = fasteval::Slab::new();
    let parsed = fasteval::Parser::new()
        .parse(expr, &mut slab.ps)
        .map_err(|e| ExprError::Parse {
            key,
            expr: crate::config::file::clip(expr, 80),
            reason: in_words(&e),
        })?;
    let mut ns = |name: &str, args: Vec<f64>| -> Option<f64> {
        (name == "ram" && args.is_empty()).then_some(ram_mib as f64)
    };
    let value = parsed
        .from(&slab.ps)
        .eval(&slab, &mut ns)
        .map_err(|e| ExprError::Eval {
            key,
            expr: crate::config::file::clip(expr, 80),
            reason: in_words(&e),
        })?;
    // zram-generator's rule: negative and NaN results are errors; +inf saturates.
    if value >= 0.0 {
        Ok(value)
    } else {
        Err(ExprError::Negative {
            key,
            expr: expr.to_string(),
            value,
            ram_mib,
        })
    }
}

/// fasteval's error in words (its own text is its Rust debug form).
fn in_words(e: &fasteval::Error) -> String {
    use fasteval::Error as E;
    match e {
        E::EOF | E::EofWhileParsing(_) => "it ends where a value should follow".into(),
        E::TooLong => "it is longer than the evaluator takes (4 KiB)".into(),
        E::TooDeep => "it nests deeper than the evaluator takes".into(),
        E::SlabOverflow => "it has more parts than the evaluator takes".into(),
        E::UnparsedTokensRemaining(rest) => format!(
            "{:?} is left over after the expression",
            crate::config::file::clip(rest, 40)
        ),
        E::Undefined(name) => format!("{:?} is not defined", crate::config::file::clip(name, 40)),
        E::ParseF64(what) => format!("{:?} is not a number", crate::config::file::clip(what, 40)),
        E::Expected(what) => format!("expected {}", crate::config::file::clip(what, 40)),
        E::WrongArgs(what) => format!(
            "{} is given the wrong arguments",
            crate::config::file::clip(what, 40)
        ),
        other => crate::config::file::clip(&format!("{other:?}"), 80),
    }
}

/// MiB to bytes as zram-generator converts them (truncating; +inf and overflow saturate).
pub fn mib_to_bytes(mib: f64) -> u64 {
    (mib * 1024.0 * 1024.0) as u64
}

/// MemTotal from `/proc/meminfo` text, in whole MiB (zram-generator's `ram`).
pub fn mem_total_mib(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some("MemTotal:"), Some(kb)) => kb.parse::<u64>().ok().map(|kb| kb / 1024),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn bytes(expr: &str, ram_mib: u64) -> u64 {
        mib_to_bytes(eval_mib("zram-size", expr, ram_mib).unwrap())
    }

    /// zram-generator's own examples: its man page (zram-generator.conf(5)), its example
    /// config (zram-generator.conf.example) and the table of its unit tests (src/config.rs).
    #[test]
    fn zram_generator_examples() {
        // Man page: the default, min(ram / 2, 4096): 1:2 up to 4 GiB (the graph: 512M at 1G,
        // 2G at 4G, 4G at 8G and above).
        let default = "min(ram / 2, 4096)";
        assert_eq!(bytes(default, 1024), 512 * MIB);
        assert_eq!(bytes(default, 4096), 2048 * MIB);
        assert_eq!(bytes(default, 8192), 4096 * MIB);
        assert_eq!(bytes(default, 65536), 4096 * MIB);
        // Man page: piecewise linear, 1:1 for the first 4G, then 1:2, up to 32G.
        let piecewise = "min(min(ram, 4096) + max(ram - 4096, 0) / 2, 32 * 1024)";
        assert_eq!(bytes(piecewise, 1024), 1024 * MIB);
        assert_eq!(bytes(piecewise, 4096), 4096 * MIB);
        assert_eq!(bytes(piecewise, 8192), 6144 * MIB);
        assert_eq!(bytes(piecewise, 12288), 8192 * MIB);
        assert_eq!(bytes(piecewise, 61440), 32768 * MIB);
        assert_eq!(bytes(piecewise, 65536), 32768 * MIB);
        // Example config: "if the machine has 1 GiB, and zram-size=ram/4, then the zram
        // device will have 256 MiB"; ram / 10; min(ram / 10, 2048); resident limit ram / 8.
        assert_eq!(bytes("ram/4", 1024), 256 * MIB);
        assert_eq!(bytes("ram / 10", 10240), 1024 * MIB);
        assert_eq!(bytes("min(ram / 10, 2048)", 40960), 2048 * MIB);
        assert_eq!(bytes("ram/8", 1024), 128 * MIB);
        // Unit tests of src/config.rs.
        assert_eq!(bytes("0.5 * ram", 100), 50 * MIB);
        assert_eq!(bytes("500", 5000), 500 * MIB);
        assert_eq!(bytes("500k", 5000), 500 * 1000 * MIB);
        assert_eq!(
            bytes("32G", 5000),
            32 * 1_000_000_000 * MIB,
            "G is 10^9 (of MiB)"
        );
        assert_eq!(bytes("min(0.5 * ram, 4000)", 3000), 1500 * MIB);
        assert_eq!(bytes("(ram-99)/0", 100), u64::MAX, "+inf saturates");
        assert!(matches!(
            eval_mib("zram-size", "(ram-100)/0", 100),
            Err(ExprError::Negative { .. })
        ));
        assert!(matches!(
            eval_mib("zram-size", "array(1,2)", 100),
            Err(ExprError::Eval { .. })
        ));
        // Resident limit default "0": no limit.
        assert_eq!(bytes("0", 4096), 0);
    }

    #[test]
    fn errors_name_the_key() {
        for (expr, kind) in [
            ("ram /", "not a valid expression"),
            ("ram * swap", "cannot be evaluated"),
            ("2 - ram", "must be 0 or more"),
        ] {
            let err = eval_mib("zram-resident-limit", expr, 1024).unwrap_err();
            let msg = err.to_string();
            assert!(msg.starts_with("zram-resident-limit = "), "{msg}");
            assert!(msg.contains(kind), "{expr}: {msg}");
        }
    }

    #[test]
    fn mem_total_is_whole_mib() {
        let meminfo = "MemTotal:        8013220 kB\nMemFree:          721288 kB\n";
        assert_eq!(mem_total_mib(meminfo), Some(7825));
        assert_eq!(mem_total_mib("MemFree: 1 kB\n"), None);
        let real = std::fs::read_to_string("/proc/meminfo").unwrap();
        assert!(mem_total_mib(&real).unwrap() > 0);
    }

    /// The evaluator's errors in words, and a long expression quoted cut.
    #[test]
    fn errors_are_in_words() {
        let long = "1+".repeat(3000) + "1";
        for (expr, want) in [
            ("ram +", "it ends where a value should follow"),
            ("x * 2", "\"x\" is not defined"),
            ("ram 5", "\"5\" is left over"),
            (long.as_str(), "longer than the evaluator takes"),
        ] {
            let err = eval_mib("zram-size", expr, 1024).unwrap_err().to_string();
            assert!(err.contains(want), "{expr:.40}: {err}");
            assert!(!err.contains("(\""), "no debug form: {err}");
            assert!(err.len() < 400, "{} bytes", err.len());
        }
    }
}
