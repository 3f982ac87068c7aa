//! The synthetic tasks hold the structure their docs promise, deterministically.

use std::collections::{HashMap, HashSet};

use super::*;
use crate::Error;

fn field_of(spec: &SynthSpec) -> String {
    match spec.validate(Path::new("d.toml")) {
        Err(Error::Config { field, .. }) => field,
        other => panic!("expected a Config error, got {other:?}"),
    }
}

#[test]
fn defaults_fill_every_field_and_unknown_fields_are_refused() {
    let spec: SynthSpec = toml::from_str("kind = \"language\"\nbranching = 2").unwrap();
    let want = LanguageConfig {
        branching: 2,
        ..Default::default()
    };
    assert_eq!(spec, SynthSpec::Language(want));
    assert!(toml::from_str::<SynthSpec>("kind = \"images\"\nvocab = 2").is_err());
    assert!(toml::from_str::<SynthSpec>("kind = \"audio\"").is_err());
    for spec in [
        SynthSpec::Language(LanguageConfig::default()),
        SynthSpec::Images(ImagesConfig::default()),
        SynthSpec::Teacher(TeacherConfig::default()),
    ] {
        let text = toml::to_string(&spec).unwrap();
        assert_eq!(toml::from_str::<SynthSpec>(&text).unwrap(), spec, "{text}");
    }
}

#[test]
fn the_same_seed_gives_the_same_data_and_another_seed_other_data() {
    let specs = [
        SynthSpec::Language(LanguageConfig::default()),
        SynthSpec::Images(ImagesConfig {
            samples: 20,
            ..Default::default()
        }),
        SynthSpec::Teacher(TeacherConfig {
            samples: 20,
            ..Default::default()
        }),
    ];
    for spec in specs {
        let reseeded = |seed, sample_seed| match spec.clone() {
            SynthSpec::Language(c) => SynthSpec::Language(LanguageConfig {
                seed,
                sample_seed,
                ..c
            }),
            SynthSpec::Images(c) => SynthSpec::Images(ImagesConfig {
                seed,
                sample_seed,
                ..c
            }),
            SynthSpec::Teacher(c) => SynthSpec::Teacher(TeacherConfig {
                seed,
                sample_seed,
                ..c
            }),
        };
        let a = generate(&spec).unwrap();
        assert_eq!(a, generate(&spec).unwrap(), "{}", spec.kind());
        assert_ne!(a, generate(&reseeded(1, 0)).unwrap(), "{}", spec.kind());
        assert_ne!(a, generate(&reseeded(0, 1)).unwrap(), "{}", spec.kind());
    }
}

#[test]
fn sample_seed_draws_other_samples_of_the_same_task() {
    // Without shift and noise an image is its class's texture: the task alone.
    let still = |seed, sample_seed| {
        let cfg = ImagesConfig {
            samples: 10,
            noise: 0.0,
            max_shift: 0,
            seed,
            sample_seed,
            ..Default::default()
        };
        generate(&SynthSpec::Images(cfg)).unwrap()["x"].clone()
    };
    assert_eq!(still(0, 0), still(0, 1));
    assert_ne!(still(0, 0), still(1, 0));
    // A language's rules: the successors seen after each token.
    let successors = |sample_seed| {
        let cfg = LanguageConfig {
            sample_seed,
            samples: 2000,
            ..Default::default()
        };
        let t = generate(&SynthSpec::Language(cfg)).unwrap()["tokens"].clone();
        let mut seen: Vec<HashSet<i64>> = vec![HashSet::new(); 64];
        for w in t.as_i64().unwrap().chunks(33) {
            for p in w.windows(2) {
                seen[p[0] as usize].insert(p[1]);
            }
        }
        seen
    };
    assert_eq!(successors(0), successors(1));
}

#[test]
fn language_rows_follow_sparse_rules_at_the_entropy_floor() {
    for order in [1, 2] {
        let cfg = LanguageConfig {
            vocab: 16,
            order,
            branching: 3,
            samples: 4000,
            ..Default::default()
        };
        let tokens = generate(&SynthSpec::Language(cfg.clone())).unwrap()["tokens"].clone();
        assert_eq!(tokens.shape, vec![4000, cfg.seq + 1]);
        let t = tokens.as_i64().unwrap();
        assert!(t.iter().all(|&v| (0..16).contains(&v)));
        // Successor counts per context: at most `branching` distinct, near-uniform.
        let mut next: HashMap<&[i64], HashMap<i64, usize>> = HashMap::new();
        for row in t.chunks(cfg.seq + 1) {
            for pos in order..row.len() {
                *next
                    .entry(&row[pos - order..pos])
                    .or_default()
                    .entry(row[pos])
                    .or_default() += 1;
            }
        }
        assert_eq!(
            next.len(),
            16usize.pow(order as u32),
            "every context occurs"
        );
        let (mut h, mut total) = (0.0, 0.0);
        for counts in next.values() {
            assert!(counts.len() <= 3, "{counts:?}");
            let n: usize = counts.values().sum();
            for &k in counts.values() {
                let p = k as f64 / n as f64;
                h -= k as f64 * p.ln();
            }
            total += n as f64;
        }
        let empirical = h / total;
        assert!(
            (empirical - 3f64.ln()).abs() < 0.01,
            "order {order}: {empirical} vs ln 3"
        );
    }
    let floor = |order| {
        LanguageConfig {
            order,
            ..Default::default()
        }
        .entropy_floor()
    };
    assert!((floor(1) - 4f64.ln()).abs() < 1e-12);
    let two = (64f64.ln() + 31.0 * 4f64.ln()) / 32.0;
    assert!((floor(2) - two).abs() < 1e-12);
}

#[test]
fn images_are_balanced_and_classes_differ() {
    let cfg = ImagesConfig {
        samples: 40,
        noise: 0.0,
        max_shift: 0,
        ..Default::default()
    };
    let d = generate(&SynthSpec::Images(cfg)).unwrap();
    assert_eq!(d["x"].shape, vec![40, 3, 32, 32]);
    let y = d["y"].as_i64().unwrap();
    assert_eq!(y, (0..40).map(|i| i % 10).collect::<Vec<i64>>().as_slice());
    // Without shift and noise, a class's images are identical and other classes' differ.
    let x = d["x"].as_f32().unwrap();
    let img = |i: usize| &x[i * 3072..(i + 1) * 3072];
    assert_eq!(img(0), img(10));
    assert_ne!(img(0), img(1));
    let var = img(0).iter().map(|v| v * v).sum::<f32>() / 3072.0;
    assert!((0.3..3.0).contains(&var), "texture power {var}");
}

#[test]
fn teacher_labels_cover_the_classes() {
    let cfg = TeacherConfig {
        samples: 2000,
        inputs: 20,
        ..Default::default()
    };
    let d = generate(&SynthSpec::Teacher(cfg)).unwrap();
    assert_eq!(d["x"].shape, vec![2000, 20]);
    let seen: HashSet<i64> = d["y"].as_i64().unwrap().iter().copied().collect();
    assert_eq!(seen, (0..10).collect());
}

#[test]
fn bad_settings_name_their_field() {
    let lang = |f: fn(&mut LanguageConfig)| {
        let mut c = LanguageConfig::default();
        f(&mut c);
        field_of(&SynthSpec::Language(c))
    };
    assert_eq!(lang(|c| c.branching = 65), "synth.branching");
    assert_eq!(lang(|c| c.samples = 0), "synth.samples");
    assert_eq!(lang(|c| c.order = 9), "synth.order");
    assert_eq!(lang(|c| c.seq = usize::MAX), "synth.samples");
    let img = |f: fn(&mut ImagesConfig)| {
        let mut c = ImagesConfig::default();
        f(&mut c);
        field_of(&SynthSpec::Images(c))
    };
    assert_eq!(img(|c| c.noise = -1.0), "synth.noise");
    assert_eq!(img(|c| c.noise = f32::INFINITY), "synth.noise");
    assert_eq!(img(|c| c.image_size = 1 << 20), "synth.samples");
    let teacher = TeacherConfig {
        hidden: 0,
        ..Default::default()
    };
    assert_eq!(field_of(&SynthSpec::Teacher(teacher)), "synth.hidden");
}

#[test]
#[cfg(feature = "cli")]
fn the_command_writes_the_file_and_names_bad_options() {
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        data: DataCommand,
    }
    Cli::command().debug_assert();
    let dir = std::env::temp_dir().join(format!("pipetrain-synth-cli-{}", std::process::id()));
    let out = dir.join("a/lang.npz");
    let args = [
        "data",
        "synth",
        "language",
        "--samples",
        "8",
        "--seq",
        "4",
        "-o",
    ];
    let cli = Cli::try_parse_from(args.iter().copied().chain([out.to_str().unwrap()])).unwrap();
    let summary = data_command(cli.data).unwrap();
    assert!(
        summary.starts_with("language: tokens i64 [8, 5] (entropy floor 1.3863 nats/token)"),
        "{summary}"
    );
    let back = crate::data::read_npz(&out).unwrap();
    assert_eq!(back["tokens"].shape, vec![8, 5]);
    std::fs::remove_dir_all(&dir).unwrap();

    let args = ["data", "synth", "images", "--noise=-1", "-o", "x.npz"];
    let cli = Cli::try_parse_from(args).unwrap();
    match data_command(cli.data) {
        Err(Error::Config { field, .. }) => assert_eq!(field, "--noise"),
        other => panic!("{other:?}"),
    }
}
