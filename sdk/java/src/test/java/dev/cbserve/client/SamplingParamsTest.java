package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import cbserve.v1.Types;
import java.util.ArrayList;
import java.util.EnumSet;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.junit.jupiter.api.Test;

/** The SamplingParams message the client sends, and the finish reasons it reads (no server). */
class SamplingParamsTest {

  @Test
  void stopStringsGoInTheMessageInOrder() {
    SamplingParams params = SamplingParams.builder().stop("\n\n", "User:", "a").build();
    assertEquals(List.of("\n\n", "User:", "a"), params.toProto().getStopList());
    SamplingParams fromList = SamplingParams.builder().stop(List.of("b", "a")).build();
    assertEquals(List.of("b", "a"), fromList.toProto().getStopList());
    assertEquals(List.of(), SamplingParams.defaults().toProto().getStopList());
  }

  @Test
  void stopStringsAreCopiedAndTheLastSettingWins() {
    List<String> stop = new ArrayList<>(List.of("x", "y"));
    String[] array = {"p", "q"};
    SamplingParams.Builder builder = SamplingParams.builder().stop(array);
    array[0] = "changed";
    assertEquals(List.of("p", "q"), builder.build().toProto().getStopList());

    SamplingParams params = builder.stop(stop).build();
    stop.add("z");
    assertEquals(List.of("x", "y"), params.toProto().getStopList());
    assertEquals("SamplingParams{stop=[x, y]}", params.toString());
    assertEquals(List.of(), builder.stop().build().toProto().getStopList());
  }

  @Test
  void nullStopStringsAreRefused() {
    SamplingParams.Builder builder = SamplingParams.builder();
    NullPointerException e =
        assertThrows(NullPointerException.class, () -> builder.stop("ok", null));
    assertEquals("stop[1]", e.getMessage());
    assertThrows(NullPointerException.class, () -> builder.stop((String[]) null));
    assertThrows(NullPointerException.class, () -> builder.stop((List<String>) null));
  }

  @Test
  void penaltiesAndMinNewTokensGoInTheMessage() {
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(8)
            .repetitionPenalty(1.25)
            .presencePenalty(-0.5)
            .frequencyPenalty(1.5)
            .minNewTokens(3)
            .build();
    Types.SamplingParams proto = params.toProto();
    assertTrue(proto.hasRepetitionPenalty());
    assertEquals(1.25f, proto.getRepetitionPenalty());
    assertTrue(proto.hasPresencePenalty());
    assertEquals(-0.5f, proto.getPresencePenalty());
    assertTrue(proto.hasFrequencyPenalty());
    assertEquals(1.5f, proto.getFrequencyPenalty());
    assertTrue(proto.hasMinNewTokens());
    assertEquals(3, proto.getMinNewTokens());
    assertEquals(
        "SamplingParams{maxNewTokens=8, repetitionPenalty=1.25, presencePenalty=-0.5,"
            + " frequencyPenalty=1.5, minNewTokens=3}",
        params.toString());
  }

  @Test
  void zeroPenaltiesAreSentAndUnsetOnesAreNot() {
    // 0 (and 1 for repetitionPenalty) is a value the caller gave: it must reach the server as set.
    Types.SamplingParams zeros =
        SamplingParams.builder()
            .repetitionPenalty(1)
            .presencePenalty(0)
            .frequencyPenalty(0)
            .minNewTokens(0)
            .build()
            .toProto();
    assertTrue(zeros.hasRepetitionPenalty());
    assertTrue(zeros.hasPresencePenalty());
    assertTrue(zeros.hasFrequencyPenalty());
    assertTrue(zeros.hasMinNewTokens());

    Types.SamplingParams unset = SamplingParams.builder().maxNewTokens(4).build().toProto();
    assertFalse(unset.hasRepetitionPenalty());
    assertFalse(unset.hasPresencePenalty());
    assertFalse(unset.hasFrequencyPenalty());
    assertFalse(unset.hasMinNewTokens());
    Types.SamplingParams defaults = SamplingParams.defaults().toProto();
    assertFalse(defaults.hasRepetitionPenalty());
    assertFalse(defaults.hasPresencePenalty());
    assertFalse(defaults.hasFrequencyPenalty());
    assertFalse(defaults.hasMinNewTokens());
    assertEquals("SamplingParams{}", SamplingParams.defaults().toString());

    Types.SamplingParams onlyPresence =
        SamplingParams.builder().presencePenalty(2).build().toProto();
    assertTrue(onlyPresence.hasPresencePenalty());
    assertFalse(onlyPresence.hasRepetitionPenalty());
    assertFalse(onlyPresence.hasFrequencyPenalty());
    assertFalse(onlyPresence.hasMinNewTokens());
  }

  @Test
  void negativeMinNewTokensIsRefused() {
    SamplingParams.Builder builder = SamplingParams.builder();
    IllegalArgumentException e =
        assertThrows(IllegalArgumentException.class, () -> builder.minNewTokens(-1));
    assertTrue(e.getMessage().contains("minNewTokens"), e.getMessage());
    assertFalse(builder.build().toProto().hasMinNewTokens());
  }

  @Test
  void logitBiasGoesInTheMessage() {
    Map<Integer, Double> bias = new LinkedHashMap<>();
    bias.put(7, 100.0);
    bias.put(3, -100.0);
    bias.put(0, 0.5);
    SamplingParams params = SamplingParams.builder().maxNewTokens(2).logitBias(bias).build();
    assertEquals(Map.of(0, 0.5f, 3, -100f, 7, 100f), params.toProto().getLogitBiasMap());
    // Ordered by token id, whatever the caller's order.
    assertEquals(
        "SamplingParams{maxNewTokens=2, logitBias={0=0.5, 3=-100.0, 7=100.0}}", params.toString());
  }

  @Test
  void logitBiasIsCopiedAndTheLastSettingWins() {
    Map<Integer, Double> bias = new HashMap<>(Map.of(5, -1.5));
    SamplingParams.Builder builder = SamplingParams.builder().logitBias(bias);
    bias.put(6, 2.0);
    bias.put(5, 9.0);
    SamplingParams params = builder.build();
    bias.clear();
    assertEquals(Map.of(5, -1.5f), params.toProto().getLogitBiasMap());
    assertEquals("SamplingParams{logitBias={5=-1.5}}", params.toString());

    SamplingParams replaced = builder.logitBias(Map.of(9, 1.0)).build();
    assertEquals(Map.of(9, 1f), replaced.toProto().getLogitBiasMap());
    assertEquals(Map.of(5, -1.5f), params.toProto().getLogitBiasMap());
    SamplingParams cleared = builder.logitBias(Map.of()).build();
    assertEquals(Map.of(), cleared.toProto().getLogitBiasMap());
    assertEquals("SamplingParams{}", cleared.toString());
  }

  @Test
  void unsetLogitBiasIsEmpty() {
    assertEquals(Map.of(), SamplingParams.defaults().toProto().getLogitBiasMap());
    SamplingParams unset = SamplingParams.builder().maxNewTokens(4).build();
    assertEquals(0, unset.toProto().getLogitBiasCount());
    assertEquals("SamplingParams{maxNewTokens=4}", unset.toString());
  }

  @Test
  void negativeOrNullLogitBiasEntriesAreRefused() {
    SamplingParams.Builder builder = SamplingParams.builder().logitBias(Map.of(1, 1.0));
    IllegalArgumentException negative =
        assertThrows(
            IllegalArgumentException.class, () -> builder.logitBias(Map.of(2, 1.0, -1, 1.0)));
    assertTrue(negative.getMessage().contains("logitBias"), negative.getMessage());
    assertTrue(negative.getMessage().contains("-1"), negative.getMessage());

    Map<Integer, Double> nullId = new HashMap<>();
    nullId.put(null, 1.0);
    assertThrows(NullPointerException.class, () -> builder.logitBias(nullId));
    Map<Integer, Double> nullBias = new HashMap<>();
    nullBias.put(4, null);
    NullPointerException e =
        assertThrows(NullPointerException.class, () -> builder.logitBias(nullBias));
    assertEquals("logitBias[4]", e.getMessage());
    assertThrows(NullPointerException.class, () -> builder.logitBias(null));
    // A refused setting leaves the earlier one in place.
    assertEquals(Map.of(1, 1f), builder.build().toProto().getLogitBiasMap());
  }

  @Test
  void finishReasonStopMapsToStop() {
    assertEquals(FinishReason.STOP, Convert.finishReason(Types.FinishReason.FINISH_REASON_STOP));
  }

  @Test
  void everyFinishReasonOfTheProtoMapsToTheWrapperOfTheSameName() {
    Set<FinishReason> mapped = EnumSet.noneOf(FinishReason.class);
    for (Types.FinishReason reason : Types.FinishReason.values()) {
      if (reason == Types.FinishReason.FINISH_REASON_UNSPECIFIED
          || reason == Types.FinishReason.UNRECOGNIZED) {
        continue;
      }
      FinishReason wrapper = Convert.finishReason(reason);
      assertNotNull(wrapper, reason + " has no wrapper");
      assertEquals(reason.name(), "FINISH_REASON_" + wrapper.name());
      mapped.add(wrapper);
    }
    assertEquals(EnumSet.allOf(FinishReason.class), mapped);
  }
}
