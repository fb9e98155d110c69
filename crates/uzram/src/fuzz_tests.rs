//! Fuzz targets for everything the binary reads from outside (see `uzram_core::fuzz`): a
//! store's header as a takeover reads it, a device's recovery record, config files and
//! size expressions, and control-protocol lines. Each runs a fixed budget on every
//! `cargo test` (`UZRAM_FUZZ_CASES`); by hand, as long as wanted:
//! `UZRAM_FUZZ_CASES=1000000 cargo test --release -p uzram fuzz_`.

use uzram_core::fuzz;

use crate::config::file::parse_config;
use crate::config::{Host, Plan};
use crate::control::proto::{decode, encode, Request, Response};

const HOST: Host = Host::with_ram(4096);

#[test]
fn fuzz_config_files_are_refused_or_make_a_device_the_host_holds() {
    let example = include_str!("../../../systemd/uzram.toml.example")
        .as_bytes()
        .to_vec();
    let seeds: Vec<Vec<u8>> = [
        &example[..],
        b"zram-size = \"min(ram / 2, 4096)\"\ncompression-algorithm = \"zstd\"\n",
        b"size = \"8G\"\nmem-limit = \"1G\"\nqueues = 4\ndepth = 128\nbackend = \"auto\"\n",
        b"zram-size = 2048\nzram-resident-limit = \"ram / 8\"\nhost-memory-limit = \"none\"\n",
        b"size = 1048576\ngpu-memory = \"256M\"\ngpus = \"0,1\"\nchecksums = false\n",
    ]
    .iter()
    .map(|s| s.to_vec())
    .collect();
    fuzz::run("config", &seeds, 4096, |input| {
        let text = String::from_utf8_lossy(input);
        let Ok(Plan::Device(run)) = parse_config(std::path::Path::new("fuzz.toml"), &text, HOST)
        else {
            return;
        };
        let d = run.device;
        assert!(d.size > 0 && d.size % 4096 == 0 && d.size <= crate::size::MAX_SIZE);
        let writeback = match d.writeback {
            Some(_) => crate::footprint::Writeback::File,
            None => crate::footprint::Writeback::None,
        };
        let upfront = crate::footprint::Upfront::of(
            d.size,
            d.queues,
            d.depth,
            d.gpu_pinned_bytes(),
            writeback,
        )
        .expect("an accepted device's up-front memory is known");
        assert!(
            upfront.check(HOST.ram_mib << 20).is_ok(),
            "an accepted device does not fit the host: {upfront:?}"
        );
        if let Some(limit) = d.mem_limit {
            assert!(limit >= uzram_core::PageStore::table_bytes_for(d.size / 4096).unwrap());
        }
    });
}

#[test]
fn fuzz_sizes_and_expressions_never_panic() {
    let seeds: Vec<Vec<u8>> = [
        "8G",
        "1540M",
        "4096",
        "16T",
        "min(ram / 2, 4096)",
        "ram * 0.5 + 10",
        "max(ram, 1) / 3",
        "((ram))",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    fuzz::run("sizes", &seeds, 256, |input| {
        let text = String::from_utf8_lossy(input);
        if let Ok(bytes) = crate::size::parse_size(&text) {
            assert!(bytes > 0 && bytes % 4096 == 0 && bytes <= crate::size::MAX_SIZE);
        }
        if let Ok(mib) = crate::sizeexpr::eval_mib("zram-size", &text, HOST.ram_mib) {
            assert!(!mib.is_nan(), "{text:?} evaluated to NaN");
        }
    });
}

#[test]
fn fuzz_control_lines_decode_or_are_refused() {
    let seeds: Vec<Vec<u8>> = [
        encode(&Request::Status),
        encode(&Request::Stop),
        encode(&Request::Handoff),
        encode(&Response::Stopping),
        "{\"cmd\":\"status\",\"extra\":[1,2,{\"a\":null}]}\n".to_string(),
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    fuzz::run("control", &seeds, 1024, |input| {
        let line = String::from_utf8_lossy(input);
        if let Ok(req) = decode::<Request>(&line) {
            assert_eq!(decode::<Request>(&encode(&req)).unwrap(), req);
        }
        if let Ok(resp) = decode::<Response>(&line) {
            assert_eq!(decode::<Response>(&encode(&resp)).unwrap(), resp);
        }
    });
}

#[test]
fn fuzz_recovery_records_are_refused_or_pass_every_check() {
    fuzz::run(
        "record",
        &crate::takeover::record::fuzz_seeds(),
        16 << 10,
        |input| crate::takeover::record::fuzz_check(input, HOST),
    );
}

#[test]
fn fuzz_store_headers_are_refused_or_lie_inside_their_segment() {
    fuzz::run(
        "store_header",
        &crate::takeover::store_segment::fuzz_seeds(),
        512,
        crate::takeover::store_segment::fuzz_check,
    );
}
