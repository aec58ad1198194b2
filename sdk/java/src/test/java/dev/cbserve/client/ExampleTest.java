package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.PrintStream;
import java.lang.reflect.Method;
import java.net.URL;
import java.net.URLClassLoader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.tools.JavaCompiler;
import javax.tools.ToolProvider;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/** The README's quick-start example compiles and runs as written (against the test server). */
class ExampleTest extends ServerTest {
  private static final Pattern JAVA_BLOCK = Pattern.compile("```java\\n(.*?)```", Pattern.DOTALL);

  @Test
  void readmeExampleRuns(@TempDir Path dir) throws Exception {
    String readme = Files.readString(Paths.get("README.md"), StandardCharsets.UTF_8);
    String example = null;
    Matcher m = JAVA_BLOCK.matcher(readme);
    while (m.find()) {
      if (m.group(1).contains("public class Example")) {
        example = m.group(1);
        break;
      }
    }
    assertTrue(example != null, "README.md has a java block with `public class Example`");
    assertTrue(example.contains("\"127.0.0.1:50051\""));
    Path source = dir.resolve("Example.java");
    Files.writeString(source, example.replace("127.0.0.1:50051", server.target));

    JavaCompiler javac = ToolProvider.getSystemJavaCompiler();
    ByteArrayOutputStream diagnostics = new ByteArrayOutputStream();
    int rc =
        javac.run(
            null,
            diagnostics,
            diagnostics,
            List.of(
                    "-Xlint:all",
                    "-Werror",
                    "-classpath",
                    System.getProperty("java.class.path"),
                    "-d",
                    dir.toString(),
                    source.toString())
                .toArray(new String[0]));
    assertEquals(0, rc, diagnostics.toString(StandardCharsets.UTF_8));

    PrintStream stdout = System.out;
    ByteArrayOutputStream out = new ByteArrayOutputStream();
    try (URLClassLoader loader =
        new URLClassLoader(new URL[] {dir.toUri().toURL()}, getClass().getClassLoader())) {
      Method main = loader.loadClass("Example").getMethod("main", String[].class);
      System.setOut(new PrintStream(out, true, StandardCharsets.UTF_8));
      main.invoke(null, (Object) new String[0]);
    } finally {
      System.setOut(stdout);
    }
    String printed = out.toString(StandardCharsets.UTF_8);
    assertTrue(printed.contains("[LENGTH]"), printed);
  }
}
