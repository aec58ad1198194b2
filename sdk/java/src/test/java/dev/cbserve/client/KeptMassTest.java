package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * The kept probability mass against the test server ({@link
 * SamplingParams.Builder#returnKeptMass(boolean)}): each token's {@link TokenLogprob#logKeptMass()}
 * equals the renormalising constant of top-k, top-p and min-p computed here from the same step's raw
 * log-probabilities (temperature 1, so the raw distribution is the one they truncate), and a
 * processed log-probability plus it is the raw one.
 */
class KeptMassTest extends ServerTest {
  /** A truncation; 0 leaves a filter off. */
  private record Truncation(String name, int topK, float topP, float minP) {
    SamplingParams params(LogprobsMode mode) {
      SamplingParams.Builder builder =
          SamplingParams.builder()
              .maxNewTokens(5)
              .ignoreEos(true)
              .temperature(1.0f)
              .seed(9)
              .topLogprobs(SamplingBounds.MAX_TOP_LOGPROBS)
              .logprobsMode(mode)
              .returnKeptMass(true);
      if (topK > 0) {
        builder.topK(topK);
      }
      if (topP > 0) {
        builder.topP(topP);
      }
      if (minP > 0) {
        builder.minP(minP);
      }
      return builder.build();
    }

    /**
     * The probability top-k, then top-p on what top-k kept, then min-p keep of the distribution
     * whose most likely tokens {@code top} lists (raw, most likely first); fails the test when the
     * kept tokens may reach past the listed ones.
     */
    double referenceKeptMass(List<TopLogprob> top) {
      double[] probs = top.stream().mapToDouble(t -> Math.exp(t.logprob())).toArray();
      int kept = topK > 0 ? Math.min(topK, probs.length) : probs.length;
      if (topP > 0) {
        double total = topK > 0 ? sum(probs, kept) : 1.0;
        double before = 0;
        int i = 0;
        for (; i < kept && before / total < topP; i++) {
          before += probs[i];
        }
        kept = i;
      }
      if (minP > 0) {
        int i = 0;
        while (i < kept && probs[i] >= minP * probs[0]) {
          i++;
        }
        kept = i;
      }
      if (kept == probs.length && topK != kept) {
        fail(name + ": the kept tokens reach past the " + probs.length + " listed; narrow the case");
      }
      return sum(probs, kept);
    }
  }

  private static double sum(double[] values, int count) {
    double total = 0;
    for (int i = 0; i < count; i++) {
      total += values[i];
    }
    return total;
  }

  @Test
  void keptMassEqualsTheReferenceRenormalisingConstant() {
    List<Truncation> cases =
        List.of(
            new Truncation("top-k", 5, 0, 0),
            new Truncation("top-p", 0, 0.05f, 0),
            new Truncation("min-p", 0, 0, 0.95f),
            new Truncation("top-k, top-p and min-p", 15, 0.5f, 0.85f));
    Prompt prompt = Prompt.tokens(5, 6, 7, 8);
    for (Truncation c : cases) {
      Completion raw = client.generate(prompt, c.params(LogprobsMode.RAW));
      Completion processed = client.generate(prompt, c.params(LogprobsMode.PROCESSED));
      assertEquals(raw.tokenIds(), processed.tokenIds(), c.name());
      assertEquals(5, raw.logprobs().size(), c.name());
      for (int step = 0; step < raw.logprobs().size(); step++) {
        String where = c.name() + ", step " + step;
        TokenLogprob every = raw.logprobs().get(step);
        TokenLogprob drawn = processed.logprobs().get(step);
        double expected = c.referenceKeptMass(every.top());
        assertTrue(expected < 0.999, where + ": the case must truncate, kept " + expected);
        float got = every.logKeptMass().orElseThrow(() -> new AssertionError(where + ": no kept mass"));
        assertEquals(Math.log(expected), got, 1e-4, where);
        assertEquals(got, drawn.logKeptMass().orElseThrow(), where + ": the same in processed mode");
        assertEquals(
            every.logprob(),
            drawn.logprob() + got,
            1e-4,
            where + ": processed logprob + log kept mass is the raw logprob");
      }
    }
  }

  @Test
  void keptMassIsEmptyUnlessAskedAndRefusedForGreedy() {
    SamplingParams plain =
        SamplingParams.builder().maxNewTokens(2).temperature(1.0f).topK(5).logprobs(true).build();
    for (TokenLogprob step : client.generate(Prompt.tokens(5, 6), plain).logprobs()) {
      assertTrue(step.logKeptMass().isEmpty(), step.toString());
    }
    SamplingParams greedy =
        SamplingParams.builder().maxNewTokens(2).temperature(0.0f).returnKeptMass(true).build();
    assertTrue(greedy.toString().contains("returnKeptMass=true"), greedy.toString());
    InvalidArgumentException refused =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.tokens(5, 6), greedy));
    assertTrue(
        refused.getMessage().contains("sampling.return_kept_mass needs a request that samples"),
        refused.getMessage());
  }
}
