"""`utils/host`: the processor a profile or a run record names (jax calls every CPU "cpu")."""

from parse_jax.utils.host import cpu_identity, describe_cpu

AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n" \
       "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512 = AVX2.replace("avx2 fma", "avx2 fma avx512f avx512dq")
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha1\nCPU implementer\t: 0x41\n"


def test_two_processors_under_one_name_differ_by_their_instruction_sets():
    a, b = describe_cpu(AVX2), describe_cpu(AVX512)
    assert a["cpu_model"] == b["cpu_model"] == "AMD EPYC 7B13"
    assert a["cpu_flags"] and b["cpu_flags"] and a["cpu_flags"] != b["cpu_flags"]
    assert describe_cpu(AVX2.replace("avx2 fma", "fma avx2")) == a  # the flags' order does not matter


def test_a_processor_without_a_model_name_or_a_cpuinfo_is_still_named():
    arm = describe_cpu(ARM)
    assert arm["cpu_model"] and arm["cpu_flags"] and arm["cpu_flags"] != describe_cpu(AVX2)["cpu_flags"]
    bare = describe_cpu("")
    assert bare["cpu_model"] and bare["cpu_flags"] is None and bare["cpu_count"] == cpu_identity()["cpu_count"]
