"""The rollout correction's flags (arguments.py adds them to the trainer's parser): which correction, its thresholds,
--tis-cap as the older name of token TIS, and the embedded engine's weight noise that makes engine and trainer
disagree on purpose (docs/algorithms.md, Rollout correction).

    argv ─► add_flags (parse) ─► errors (one line per bad setting) ─► resolve: the alias and the default band filled
         in, so that only args.rollout_correction, args.rollout_correction_cap and args.rollout_correction_band are read

Like arguments.py, it imports no torch: the constants of algo/rollout_correction.py are written out here and
tests/test_rollout_correction.py holds them equal.
"""

import argparse

from megatron_dppo.flags import NON_NEGATIVE, POSITIVE

# algo.rollout_correction's CORRECTIONS, DEFAULT_CAP and DEFAULT_BANDS
ROLLOUT_CORRECTIONS = ("none", "token-tis", "seq-tis", "seq-mis", "geo-rs", "icepop")
ROLLOUT_CORRECTION_CAP = 2.0
ROLLOUT_CORRECTION_BANDS = {"geo-rs": (0.999, 1.001), "icepop": (0.5, 5.0)}
CORRECTIONS_WITH_CAP = ("token-tis", "seq-tis", "seq-mis")


def add_flags(parser: argparse.ArgumentParser) -> None:
    correction = parser.add_argument_group("rollout correction (the rollout engine's and the trainer's log-probs "
                                           "disagree; docs/algorithms.md)")
    correction.add_argument("--rollout-correction", choices=ROLLOUT_CORRECTIONS, default="token-tis",
                            help="how the policy-gradient term of each token is weighted by the ratio of the "
                                 "trainer's to the engine's probability: token-tis min(ratio, C) per token; seq-tis "
                                 "min(sequence ratio, C); seq-mis the sequence ratio, sequences above C rejected; "
                                 "geo-rs sequences whose geometric-mean ratio lies outside the band rejected; icepop "
                                 "the token ratio, tokens outside the band masked; none: no weight")
    correction.add_argument("--rollout-correction-cap", type=POSITIVE, default=ROLLOUT_CORRECTION_CAP, metavar="C",
                            help="token-tis and seq-tis cap the weight at C, seq-mis rejects sequences whose ratio "
                                 "exceeds C (verl's rollout_is_threshold)")
    correction.add_argument("--rollout-correction-band", type=NON_NEGATIVE, nargs=2, default=None,
                            metavar=("LOW", "HIGH"),
                            help="the ratios geo-rs and icepop keep, LOW <= 1 <= HIGH (default: geo-rs "
                                 f"{' '.join(map(str, ROLLOUT_CORRECTION_BANDS['geo-rs']))}, verl's "
                                 "rollout_rs_threshold_lower and rollout_rs_threshold; icepop "
                                 f"{' '.join(map(str, ROLLOUT_CORRECTION_BANDS['icepop']))}, IcePop's [alpha, beta])")
    correction.add_argument("--tis-cap", type=POSITIVE, default=None, metavar="C",
                            help="the older name of --rollout-correction token-tis --rollout-correction-cap C")
    correction.add_argument("--rollout-engine-weight-noise", type=NON_NEGATIVE, default=0.0, metavar="S",
                            help="--rollout-backend embedded: the engine samples from a copy of the weights with "
                                 "seeded Gaussian noise of S times each tensor's RMS added, so that engine and trainer "
                                 "disagree by a controlled amount (logprob_gap_train_vs_rollout shows it); 0: off")


def errors(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Each threshold given to a correction that reads it, a band that keeps ratio 1, --tis-cap as the alias it is,
    and the engine's weight noise for the embedded engine only (a flag counts as given where its value is not the
    parser's default)."""
    found = []
    name = args.rollout_correction
    given = [flag for flag, dest in (("--rollout-correction", "rollout_correction"),
                                     ("--rollout-correction-cap", "rollout_correction_cap"))
             if getattr(args, dest) != parser.get_default(dest)]
    if args.tis_cap is not None:
        if "--rollout-correction" in given and name != "token-tis":
            found.append(f"--tis-cap {args.tis_cap} is --rollout-correction token-tis with that cap, but "
                         f"--rollout-correction is {name}: drop --tis-cap (give --rollout-correction-cap instead)")
        if "--rollout-correction-cap" in given and args.rollout_correction_cap != args.tis_cap:
            found.append(f"--tis-cap {args.tis_cap} and --rollout-correction-cap {args.rollout_correction_cap} give "
                         "token TIS two caps: give one of them")
        name = "token-tis"
    if "--rollout-correction-cap" in given and name not in CORRECTIONS_WITH_CAP:
        reads_band = " (this one reads --rollout-correction-band)" if name in ROLLOUT_CORRECTION_BANDS else ""
        found.append(f"--rollout-correction-cap applies to --rollout-correction {', '.join(CORRECTIONS_WITH_CAP)}, "
                     f"not {name}: drop it{reads_band}")
    if args.rollout_correction_band is not None:
        low, high = args.rollout_correction_band
        if name not in ROLLOUT_CORRECTION_BANDS:
            found.append(f"--rollout-correction-band applies to --rollout-correction "
                         f"{' and '.join(ROLLOUT_CORRECTION_BANDS)}, not {name}: drop it")
        elif not low < high:
            found.append(f"--rollout-correction-band {low} {high} is empty: give LOW < HIGH")
        elif not low <= 1.0 <= high:
            found.append(f"--rollout-correction-band {low} {high} leaves out ratio 1, where engine and trainer agree, "
                         "so it would mask every agreeing token: give LOW <= 1 <= HIGH")
    if args.rollout_engine_weight_noise and args.rollout_backend != "embedded":
        found.append(f"--rollout-engine-weight-noise perturbs the embedded engine's weights, but --rollout-backend is "
                     f"{args.rollout_backend}: drop it or use --rollout-backend embedded")
    return found


def resolve(args: argparse.Namespace) -> None:
    """The alias resolved and the band's default filled in, once the flags are known to be valid."""
    if args.tis_cap is not None:
        args.rollout_correction, args.rollout_correction_cap = "token-tis", args.tis_cap
    if args.rollout_correction_band is None:
        args.rollout_correction_band = ROLLOUT_CORRECTION_BANDS.get(args.rollout_correction)
    args.rollout_correction_band = tuple(args.rollout_correction_band) if args.rollout_correction_band else None
